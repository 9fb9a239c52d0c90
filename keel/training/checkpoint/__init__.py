"""Checkpoints: store, writes, verification, async and host snapshots, RNG state, reshard, and the loop's one seam."""
