"""Host syncs on a GPU's hot path, counted by torch itself: `logging.sync_debug: warn`.

Keel's own reads are counted on CPU by tests/test_host_syncs.py, but only a GPU shows every synchronizing CUDA
call, DeepSpeed's and torch's included. `torch.cuda.set_sync_debug_mode("warn")` makes each one a warning; this
turns it on around the optimizer steps only (not start-up, evaluation, checks or saves, which may sync by design)
from the second step on (the first one builds caches), and writes the warnings counted by call site to
`RUN_DIR/sync_debug_rank<r>.json` with one summary line in the log.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger("keel")

# torch's wording for a sync it flags (c10/cuda/CUDAFunctions.cpp `warn_or_error_on_sync`)
SYNC_WARNING = "synchronizing"


class SyncCounter:
    """Counts the synchronizing CUDA calls of each optimizer step after the first, by `file:line`."""

    def __init__(self, mode: str, device: torch.device | str, run_dir: Path, rank: int) -> None:
        self.enabled = bool(mode) and torch.device(device).type == "cuda"
        if mode and not self.enabled and rank == 0:
            log.info(
                "logging.sync_debug=%s: needs CUDA, nothing to count on %s",
                mode,
                torch.device(device).type,
            )
        self.mode = mode
        self.path = Path(run_dir) / f"sync_debug_rank{rank}.json"
        self.rank = rank
        self.steps = 0
        self.sites: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step; from the second on, under the sync debug mode with its warnings recorded."""
        self.steps += 1
        if not self.enabled or self.steps == 1:
            yield
            return
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(self.mode)
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)
        self.count(seen)

    def count(self, seen: list[warnings.WarningMessage]) -> None:
        for w in seen:
            if SYNC_WARNING in str(w.message):
                self.sites[f"{w.filename}:{w.lineno}"] += 1
            else:  # not ours to swallow: re-issue it as it came
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def report(self) -> None:
        if not self.enabled:
            return
        counted = max(self.steps - 1, 0)
        total = sum(self.sites.values())
        self.path.write_text(
            json.dumps(
                {"steps": counted, "syncs": total, "sites": dict(self.sites.most_common())},
                indent=1,
            )
        )
        log.info(
            "rank %d: %d synchronizing CUDA calls in %d optimizer steps (%.1f per step), by site in %s",
            self.rank,
            total,
            counted,
            total / max(counted, 1),
            self.path,
        )
