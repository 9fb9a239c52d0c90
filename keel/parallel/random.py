"""Random streams under tensor parallelism (Megatron's RNG tracker, reduced to what Keel uses).

Dropout on activations that are identical on every TP rank (replicated regions) must draw the same mask on all
of them, so the default torch stream is seeded the same across a TP group. Dropout on activations that differ
per TP rank (sequence-parallel shards) must draw independent masks, so it runs inside `ShardedRNG.fork()`, a
second stream seeded per TP rank.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

SHARDED_SEED_OFFSET = 2718  # Megatron's model-parallel seed offset


class ShardedRNG:
    def __init__(self, seed: int, tp_rank: int):
        self.seed = seed + SHARDED_SEED_OFFSET + tp_rank
        self.cpu_state: torch.Tensor | None = None
        self.cuda_state: torch.Tensor | None = None

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body on this stream; the caller's stream is restored and this one advances."""
        use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        devices = [torch.cuda.current_device()] if use_cuda else []
        with torch.random.fork_rng(devices=devices):
            if self.cpu_state is None:
                torch.manual_seed(self.seed)
            else:
                torch.set_rng_state(self.cpu_state)
                if use_cuda and self.cuda_state is not None:
                    torch.cuda.set_rng_state(self.cuda_state)
            yield
            self.cpu_state = torch.get_rng_state()
            self.cuda_state = torch.cuda.get_rng_state() if use_cuda else None

    def state_dict(self) -> dict:
        return {"cpu": self.cpu_state, "cuda": self.cuda_state}

    def load_state_dict(self, state: dict) -> None:
        self.cpu_state, self.cuda_state = state["cpu"], state["cuda"]


def data_parallel_seed(seed: int, topology) -> int:
    """The default stream's seed: distinct per data-parallel replica and pipeline stage, equal across TP."""
    return seed + 100_003 * topology.rank_in("pp") + topology.dp_rank


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's default streams (the run's data-parallel seed, or a rollback's)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
