"""Stability guards: each watches a step and returns a decision; the trainer acts on it (never the guard)."""
