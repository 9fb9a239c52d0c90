"""Building a run: contexts, placement, layers or pipeline stages, compile, and DeepSpeed's engine."""
