"""bench/pipeline_bubble.py: the measured pipeline bubble shrinks with m and, at p=2, tracks the analytic idle of
each schedule; bench/pipeline_schedule_model.py: the replay of DeepSpeed's schedules behind the analytic column."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("pipeline_bubble")


@pytest.fixture
def model(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("pipeline_schedule_model")


@pytest.mark.slow
def test_p2_bubble_shrinks_with_m_and_tracks_the_formula(bench):
    shape = bench.Shape(n_layers=4, steps=3)
    few, many = bench.measure(2, [1, 4], shape)
    assert many.mean_wall < few.mean_wall, (few, many)
    for row in (few, many):
        # loose: stages are not perfectly balanced (embedding vs head + loss) and p2p/gloo overhead counts as idle
        assert abs(row.mean_wall - row.analytic) < 0.15, row


@pytest.mark.slow
def test_p2_dualpipev_bubble_shrinks_with_m_and_tracks_the_replay(bench):
    """Real DualPipeV ranks (4 stages of one block over 2 ranks): 4m compute instructions per rank (summarize
    checks), and the measured idle falls with m near the replay of DeepSpeed's DualPipeVSchedule."""
    shape = bench.Shape(n_layers=4, steps=3)
    few, many = bench.measure(2, [4, 8], shape, "dualpipev")
    assert many.mean_wall < few.mean_wall, (few, many)
    for row in (few, many):
        assert abs(row.mean_wall - row.analytic) < 0.15, row  # loose, as for 1F1B above


@pytest.mark.slow
def test_p2_interleaved_bubble_shrinks_with_m_and_tracks_the_replay(bench):
    """Real interleaved ranks (4 stages of one block over 2 ranks, v=2): 4m compute instructions per rank, and the
    measured idle falls with m near the replay of Keel's InterleavedSchedule."""
    shape = bench.Shape(n_layers=4, steps=3)
    few, many = bench.measure(2, [4, 8], shape, "interleaved")
    assert many.mean_wall < few.mean_wall, (few, many)
    for row in (few, many):
        assert abs(row.mean_wall - row.analytic) < 0.15, row  # loose, as for 1F1B above


def test_summarize_on_an_ideal_timeline(bench):
    """Two equal stages, m=3, slot 1: phase m+p-1 = 4 slots, busy 3 each, so idle 1/4 = (p-1)/(m+p-1)."""
    step = {"m": 3, "busy_wall": 3.0, "busy_cpu": 3.0, "step": 4.4, "instructions": 6}
    stages = [[{**step, "compute_end": 4.0}], [{**step, "compute_end": 3.5}]]
    row = bench.summarize(2, 3, stages)
    assert row.mean_wall == pytest.approx(row.analytic) == pytest.approx(0.25)
    assert row.tail_share == pytest.approx(1 - 4.0 / 4.4)


def test_summarize_counts_both_stages_of_a_dualpipev_rank(bench, model):
    """DualPipeV: 4m compute instructions per rank (a forward and a backward on each of its two stages)."""
    step = {"m": 4, "busy_wall": 24.0, "busy_cpu": 24.0, "step": 30.0, "compute_end": 28.0, "instructions": 16}
    row = bench.summarize(2, 4, [[step], [step]], "dualpipev")
    assert row.analytic == pytest.approx(model.analytic_idle("dualpipev", 2, 4))
    assert row.mean_wall == pytest.approx(1 - 24 / 28)
    with pytest.raises(RuntimeError, match="2 stage"):
        bench.summarize(2, 4, [[{**step, "instructions": 8}], [step]], "dualpipev")


def test_plan_skips_m_below_2p_for_dualpipev_and_interleaved(bench):
    runs, skipped = bench.plan(["1f1b", "dualpipev", "interleaved"], [2, 4], [1, 2, 4, 6, 8])
    assert runs == [("1f1b", 2, [1, 2, 4, 6, 8]), ("1f1b", 4, [1, 2, 4, 6, 8]), ("dualpipev", 2, [4, 6, 8]),
                    ("dualpipev", 4, [8]), ("interleaved", 2, [4, 6, 8]), ("interleaved", 4, [8])]
    assert list(skipped) == ["dualpipev", "interleaved"] and len(skipped["dualpipev"]) == 2
    assert "m=1,2,4,6" in skipped["dualpipev"][1] and "m >= 8" in skipped["dualpipev"][1]
    assert "m=1,2,4,6" in skipped["interleaved"][1] and "a multiple of 4" in skipped["interleaved"][1]


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (3, 2), (3, 7), (4, 4), (4, 8), (8, 16)])
def test_replay_of_1f1b_gives_the_formula_on_every_rank(model, p, m):
    """DeepSpeed's TrainSchedule replayed with backward = 2 forward: every rank idles (p-1)/(m+p-1)."""
    assert model.simulate("1f1b", p, m) == pytest.approx([(p - 1) / (m + p - 1)] * p)
    model.check_1f1b([(p, m)])


@pytest.mark.parametrize("p", [2, 4])
def test_replay_of_dualpipev_idles_less_than_1f1b(model, p):
    for m in (2 * p, 3 * p, 4 * p, 8 * p):
        dualpipev = model.analytic_idle("dualpipev", p, m)
        assert 0 < dualpipev < (p - 1) / (m + p - 1), (p, m, dualpipev)
    assert model.analytic_idle("dualpipev", p, 8 * p) < model.analytic_idle("dualpipev", p, 2 * p)


def test_replay_refuses_what_dualpipev_refuses(model):
    with pytest.raises(ValueError, match="at least"):
        model.simulate("dualpipev", 2, 3)


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (2, 8, 2), (2, 6, 3), (3, 6, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2)])
def test_replay_of_interleaved_gives_megatrons_formula_on_every_rank(model, p, m, v):
    """Keel's InterleavedSchedule replayed with backward = 2 forward: every rank idles (p-1)/(v·m+p-1), below 1F1B
    and DualPipeV at the same m (the timetable adds no bubble of its own)."""
    idle = model.simulate("interleaved", p, m, chunks=v)
    assert idle == pytest.approx([model.interleaved_formula(p, m, v)] * p, abs=1e-9)
    if m >= 2 * p:
        assert model.interleaved_formula(p, m, v) < model.analytic_idle("dualpipev", p, m) < (p - 1) / (m + p - 1)
