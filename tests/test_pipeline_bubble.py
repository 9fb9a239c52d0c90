"""bench/pipeline_bubble.py: the measured pipeline bubble shrinks with m and, at p=2, tracks (p-1)/(m+p-1)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("pipeline_bubble")


@pytest.mark.slow
def test_p2_bubble_shrinks_with_m_and_tracks_the_formula(bench):
    shape = bench.Shape(n_layers=4, steps=3)
    few, many = bench.measure(2, [1, 4], shape)
    assert many.mean_wall < few.mean_wall, (few, many)
    for row in (few, many):
        # loose: stages are not perfectly balanced (embedding vs head + loss) and p2p/gloo overhead counts as idle
        assert abs(row.mean_wall - row.analytic) < 0.15, row


def test_summarize_on_an_ideal_timeline(bench):
    """Two equal stages, m=3, slot 1: phase m+p-1 = 4 slots, busy 3 each, so idle 1/4 = (p-1)/(m+p-1)."""
    step = {"m": 3, "busy_wall": 3.0, "busy_cpu": 3.0, "step": 4.4, "instructions": 6}
    stages = [[{**step, "compute_end": 4.0}], [{**step, "compute_end": 3.5}]]
    row = bench.summarize(2, 3, stages)
    assert row.mean_wall == pytest.approx(row.analytic) == pytest.approx(0.25)
    assert row.tail_share == pytest.approx(1 - 4.0 / 4.4)
