"""Every random stream that affects training, captured and restored together, so a resumed run draws exactly
what the uninterrupted one would: python, numpy, torch's CPU stream, every CUDA device's stream, and Keel's
sequence-parallel dropout stream (`ShardedRNG`, one per tensor-parallel context the model's layers hold).

A stream left out is a silent divergence after every resume (dropout masks that differ from the straight
run's), so the set lives in one place; checkpoints written before a stream was added still load, with a warning
naming the streams that restart from their seeds instead.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from keel.parallel.random import ShardedRNG

FIELDS = ("python", "numpy", "torch", "cuda", "sharded")


def sharded_rngs(model: torch.nn.Module) -> list[ShardedRNG]:
    """The distinct sequence-parallel dropout streams the model's layers use, in module order."""
    found: dict[int, ShardedRNG] = {}
    for module in model.modules():
        rng = getattr(getattr(module, "tp", None), "sharded_rng", None)
        if isinstance(rng, ShardedRNG):
            found.setdefault(id(rng), rng)
    return list(found.values())


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture(model: torch.nn.Module) -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if _cuda_in_use() else None,
        "sharded": [rng.state_dict() for rng in sharded_rngs(model)],
    }


def restore(state: dict[str, Any], model: torch.nn.Module) -> list[str]:
    """Set every stream `state` holds; returns the streams this run uses that `state` lacks (an older checkpoint,
    or another number of dropout streams), which keep their freshly seeded state."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    missing = []
    if _cuda_in_use():
        saved = state.get("cuda")
        if saved is not None and len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:
            missing.append("cuda")
    streams = sharded_rngs(model)
    saved_streams = state.get("sharded")
    if streams and (saved_streams is None or len(saved_streams) != len(streams)):
        missing.append("sharded")
    elif streams:
        for rng, saved_state in zip(streams, saved_streams):
            rng.load_state_dict(saved_state)
    return missing
