"""The next step's batch is read in the background only when it is guessed right, and never handed over wrong."""

from __future__ import annotations

import threading

import pytest
import torch

from keel.data import skip_to
from keel.training.prefetch import BatchPrefetcher


class Reads:
    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[int, int, str]] = []
        self.fail_at = fail_at

    def __call__(self, start: int, size: int) -> list[torch.Tensor]:
        self.calls.append((start, size, threading.current_thread().name))
        if start == self.fail_at:
            raise OSError(f"cannot read sample {start}")
        return [torch.arange(start, start + size)]


def test_a_right_guess_is_read_once_on_the_worker():
    reads = Reads()
    prefetcher = BatchPrefetcher(reads, pin=False)
    first = prefetcher.get(0, 4)  # nothing prefetched yet: read here
    prefetcher.prefetch(4, 4)
    second = prefetcher.get(4, 4)
    prefetcher.close()
    assert torch.equal(first[0], torch.arange(0, 4)) and torch.equal(second[0], torch.arange(4, 8))
    assert [(s, n) for s, n, _ in reads.calls] == [(0, 4), (4, 4)]
    assert reads.calls[0][2] == threading.current_thread().name
    assert reads.calls[1][2].startswith("keel-prefetch")


def test_a_wrong_guess_is_dropped_and_read_again():
    """A rollback, skip range or ramp-up moved the cursor: the prefetched batch is not used."""
    reads = Reads()
    prefetcher = BatchPrefetcher(reads, pin=False)
    prefetcher.prefetch(8, 4)
    got = prefetcher.get(20, 4)
    prefetcher.close()
    assert torch.equal(got[0], torch.arange(20, 24))
    assert [(s, n) for s, n, _ in reads.calls] == [(8, 4), (20, 4)]


@pytest.mark.fault(
    "data read fails in the prefetch worker", "error raised at the step that needs the data"
)
def test_the_workers_error_surfaces_in_the_step_that_needs_the_data():
    prefetcher = BatchPrefetcher(Reads(fail_at=8), pin=False)
    prefetcher.prefetch(8, 4)
    with pytest.raises(OSError, match="sample 8"):
        prefetcher.get(8, 4)
    prefetcher.prefetch(8, 4)
    assert torch.equal(prefetcher.get(12, 4)[0], torch.arange(12, 16))  # not needed: not raised
    prefetcher.close()


def test_skip_to_passes_every_range_the_cursor_falls_into():
    ranges = [(10, 20), (20, 25), (40, 50)]
    assert [skip_to(s, ranges) for s in (0, 10, 19, 20, 30, 45)] == [0, 25, 25, 25, 30, 50]
