"""The next step's micro-batches, read on a worker thread while this step computes.

Reading a step's samples from the memory-mapped token file (and, on CUDA, copying them into pinned memory so
the host-to-device copy can be asynchronous) would otherwise sit between two steps with the device idle. Step
N + 1's batch is predictable while step N runs — the cursor only moves by the step's size, except after a
rollback, at a skip range or a batch-size ramp change, where the guess simply misses and the read happens in
the caller's thread as before. Keyed by (first sample, batch size), so a miss can never hand over wrong data.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

Read = Callable[[int, int], list[torch.Tensor]]
Check = Callable[[list[torch.Tensor]], Any]


class BatchPrefetcher:
    """One read in flight at most: a miss waits for it before reading itself, so the sample order's caches are
    never used by two threads at once."""

    def __init__(self, read: Read, pin: bool, check: Check | None = None) -> None:
        self._read = read
        self._pin = pin
        self._check = check  # run on the read batch in the worker too, off the step's path (its verdict: get_checked)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keel-prefetch")
        self._pending: tuple[tuple[int, int], Future] | None = None

    def _load(self, start: int, size: int) -> tuple[list[torch.Tensor], Any]:
        batches = self._read(start, size)
        verdict = self._check(batches) if self._check is not None else None
        return ([b.pin_memory() for b in batches] if self._pin else batches), verdict

    def get(self, start: int, size: int) -> list[torch.Tensor]:
        """The micro-batches of samples [start, start + size): the prefetched ones if they were guessed right."""
        return self.get_checked(start, size)[0]

    def get_checked(self, start: int, size: int) -> tuple[list[torch.Tensor], Any]:
        """`get`'s micro-batches and what `check` said of them (None without a check)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            key, future = pending
            error = future.exception()
            if key == (start, size):
                if error is not None:
                    raise error  # the worker's failure surfaces in the step that needed its data
                return future.result()
        return self._load(start, size)

    def prefetch(self, start: int, size: int) -> None:
        """Start reading the micro-batches a later `get(start, size)` will ask for."""
        self._pending = ((start, size), self._pool.submit(self._load, start, size))

    def close(self) -> None:
        self._pending = None
        self._pool.shutdown(wait=True, cancel_futures=True)
