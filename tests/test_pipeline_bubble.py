"""bench/pipeline_bubble.py: real pipeline ranks under each schedule run every forward and backward they owe and
the bench's bookkeeping holds; bench/pipeline_schedule_model.py: the replay of DeepSpeed's schedules behind the
analytic column.

Whether the measured idle falls with m and tracks the analytic figure is a matter of wall time on whatever
machine runs the suite (on this shared 2-core machine, 2026-12-03: gaps to the analytic figure up to +0.39 and idle
rising with m in one run of three, with other processes taking the cores), so the bench judges it and prints its
verdict (`judge`, TRACK_TOLERANCE); it is not asserted here."""

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


def check_rows(bench, rows, schedule: str, p: int, ms: list[int]) -> None:
    """What does not depend on the machine's speed. `summarize` has already checked the counts: every rank ran one
    forward and one backward per micro-batch on each stage it holds (2m or 4m instructions a step), or it raises.
    Each rank's compute lies inside the phase (from the common barrier to the last rank's last compute), so its
    idle is a fraction in [0, 1)."""
    assert [(r.schedule, r.p, r.m) for r in rows] == [(schedule, p, m) for m in ms]
    for row in rows:
        assert len(row.idle_wall) == len(row.slot_ms) == len(row.p2p_share) == p, row
        assert all(0 <= idle < 1 for idle in row.idle_wall), row
        assert row.phase_ms > 0 and all(ms > 0 for ms in row.slot_ms) and 0 <= row.tail_share < 1, (
            row
        )
    assert all(line.startswith(f"verdict {schedule} p={p}:") for line in bench.judge(rows, p))


@pytest.mark.slow
def test_p2_1f1b_ranks_run_every_micro_batch_and_report_their_idle(bench):
    shape = bench.Shape(n_layers=4, steps=3)
    check_rows(bench, bench.measure(2, [1, 4], shape), "1f1b", 2, [1, 4])


@pytest.mark.slow
def test_p2_dualpipev_ranks_run_both_stages_and_report_their_idle(bench):
    """Real DualPipeV ranks (4 stages of one block over 2 ranks): 4m compute instructions per rank (summarize
    checks), idle per rank, and the replay of DeepSpeed's DualPipeVSchedule beside it."""
    shape = bench.Shape(n_layers=4, steps=3)
    check_rows(bench, bench.measure(2, [4, 8], shape, "dualpipev"), "dualpipev", 2, [4, 8])


@pytest.mark.slow
def test_p2_interleaved_ranks_run_every_chunk_and_report_their_idle(bench):
    """Real interleaved ranks (4 stages of one block over 2 ranks, v=2): 4m compute instructions per rank, idle per
    rank, and the replay of Keel's InterleavedSchedule beside it."""
    shape = bench.Shape(n_layers=4, steps=3)
    check_rows(bench, bench.measure(2, [4, 8], shape, "interleaved"), "interleaved", 2, [4, 8])


def test_judge_only_judges_quiet_rows(bench):
    """The bench's verdict: the trend and the tolerance over the quiet rows; disturbed rows are named, not judged."""

    def row(m, wall, analytic, on_cpu=1.0):
        return bench.Row(
            "1f1b",
            2,
            m,
            analytic,
            [wall, wall],
            [wall, wall],
            [1.0, 1.0],
            10.0,
            on_cpu,
            0.1,
            [0.0, 0.0],
        )

    tol = bench.TRACK_TOLERANCE
    good = bench.judge([row(1, 0.52, 0.5), row(4, 0.25, 0.2)], cores=2)
    assert good == [
        "verdict 1f1b p=2: idle falls with m (0.520 -> 0.250); tracks the analytic idle within "
        f"{tol} (largest gap +0.050 at m=4)"
    ]
    bad = bench.judge([row(1, 0.3, 0.5), row(4, 0.4, 0.2), row(8, 0.9, 0.1, on_cpu=0.5)], cores=2)
    assert bad == [
        "verdict 1f1b p=2: idle does NOT fall with m (0.300 -> 0.400); does NOT track the analytic idle "
        f"within {tol} (largest gap -0.200 at m=1); not judged (on-cpu < {bench.ON_CPU_QUIET}): m=8"
    ]
    # p=2 on one core: ranks share it, nothing judged
    assert bench.judge([row(4, 0.4, 0.2)], cores=1) == []


def test_summarize_on_an_ideal_timeline(bench):
    """Two equal stages, m=3, slot 1: phase m+p-1 = 4 slots, busy 3 each, so idle 1/4 = (p-1)/(m+p-1)."""
    step = {"m": 3, "busy_wall": 3.0, "busy_cpu": 3.0, "step": 4.4, "instructions": 6}
    stages = [[{**step, "compute_end": 4.0}], [{**step, "compute_end": 3.5}]]
    row = bench.summarize(2, 3, stages)
    assert row.mean_wall == pytest.approx(row.analytic) == pytest.approx(0.25)
    assert row.tail_share == pytest.approx(1 - 4.0 / 4.4)


def test_summarize_counts_both_stages_of_a_dualpipev_rank(bench, model):
    """DualPipeV: 4m compute instructions per rank (a forward and a backward on each of its two stages)."""
    step = {
        "m": 4,
        "busy_wall": 24.0,
        "busy_cpu": 24.0,
        "step": 30.0,
        "compute_end": 28.0,
        "instructions": 16,
    }
    row = bench.summarize(2, 4, [[step], [step]], "dualpipev")
    assert row.analytic == pytest.approx(model.analytic_idle("dualpipev", 2, 4))
    assert row.mean_wall == pytest.approx(1 - 24 / 28)
    with pytest.raises(RuntimeError, match="2 stage"):
        bench.summarize(2, 4, [[{**step, "instructions": 8}], [step]], "dualpipev")


def test_plan_skips_m_below_2p_for_dualpipev_and_interleaved(bench):
    runs, skipped = bench.plan(["1f1b", "dualpipev", "interleaved"], [2, 4], [1, 2, 4, 6, 8])
    assert runs == [
        ("1f1b", 2, [1, 2, 4, 6, 8]),
        ("1f1b", 4, [1, 2, 4, 6, 8]),
        ("dualpipev", 2, [4, 6, 8]),
        ("dualpipev", 4, [8]),
        ("interleaved", 2, [4, 6, 8]),
        ("interleaved", 4, [8]),
    ]
    assert list(skipped) == ["dualpipev", "interleaved"] and len(skipped["dualpipev"]) == 2
    assert "m=1,2,4,6" in skipped["dualpipev"][1] and "m >= 8" in skipped["dualpipev"][1]
    assert (
        "m=1,2,4,6" in skipped["interleaved"][1] and "a multiple of 4" in skipped["interleaved"][1]
    )


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


@pytest.mark.parametrize(
    "p, m, v", [(2, 4, 2), (2, 8, 2), (2, 6, 3), (3, 6, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2)]
)
def test_replay_of_interleaved_gives_megatrons_formula_on_every_rank(model, p, m, v):
    """Keel's InterleavedSchedule replayed with backward = 2 forward: every rank idles (p-1)/(v·m+p-1), below 1F1B
    and DualPipeV at the same m (the timetable adds no bubble of its own)."""
    idle = model.simulate("interleaved", p, m, chunks=v)
    assert idle == pytest.approx([model.interleaved_formula(p, m, v)] * p, abs=1e-9)
    if m >= 2 * p:
        assert (
            model.interleaved_formula(p, m, v)
            < model.analytic_idle("dualpipev", p, m)
            < (p - 1) / (m + p - 1)
        )
