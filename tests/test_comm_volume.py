"""bench/comm_volume.py: one step's collective bytes (TP, expert-parallel and Ulysses all-to-all) lie within 5% of
the analytic volume, both ways."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch.distributed as dist

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch):
    # Imported by name from a sys.path entry (not from a file spec), so the forkserver ranks can import it too.
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("comm_volume")


@pytest.mark.slow
def test_tp_collective_volume_matches_megatron(bench):
    shape = bench.Shape()
    names = [case.name for case in bench.CASES]
    assert any("sequence parallel on" in n for n in names) and any(
        "sequence parallel off" in n for n in names
    )
    assert any(n.startswith("ep=") for n in names) and any("Ulysses" in n for n in names)
    assert {case.world for case in bench.CASES} == {2}
    for case, result in zip(bench.CASES, bench.measure_all(bench.CASES, shape)):
        assert result.case is case
        assert result.calls, f"{case.name}: the recorder saw no collective"
        assert 0.95 <= result.ratio <= 1.05, (
            f"{case.name}: measured / analytic = {result.ratio:.4f}"
        )


def test_recorder_patches_only_inside_its_block(bench):
    before = {op.name: getattr(dist, op.name) for op in bench.OPS}
    with bench.CollectiveRecorder():
        assert all(getattr(dist, name) is not fn for name, fn in before.items())
    assert all(getattr(dist, name) is fn for name, fn in before.items())
