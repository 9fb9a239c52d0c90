"""Goodput: productive step time ÷ wall time from the first launch, and where the rest went.

The accounting is checked exactly on a run dir written by hand (three launches: one killed after a rollback, one
preempted, one that finishes), then on a real run that goes through the same three: a loss-spike rollback and a
crash in its first launch, a preemption (SIGUSR1) in its second, the end in its third.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.run_dir import RunDir
from keel.run_dir.goodput import LOSSES, account
from keel.tools.report.series import goodput_series, smoothed
from keel.tools.report.write import write_report
from tests.keel_runs import REPO, rank_pids
from tests.test_guards_one_rank import SPIKES


def _lines(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _step(step: int, end: float, seconds: float = 1.0, **more) -> dict:
    return {
        "step": step,
        "loss": 1.0,
        "skipped": False,
        "step_time_s": seconds,
        "time": end,
        **more,
    }


def _start(process: float, first_step_at: float, launched: float, restore: float = 0.0) -> dict:
    return {
        "event": "start",
        "time": first_step_at + 1,
        "process_started": process,
        "launched_at": launched,
        "first_step_at": first_step_at,
        "phases": {"imports": 1.0, "restore": restore},
    }


def test_every_second_is_accounted_where_it_went(tmp_path):
    layout = RunDir(tmp_path)
    # launch 1 at t=0: start-up until 10; steps 1-4 end at 11..14 (step 2 saved a checkpoint after it: the stall
    # is on step 3's record; step 4 has an evaluation); a rollback from step 6 to 4 (steps 5, 6 thrown away,
    # 0.5 s of reloading); steps 5, 6 again, then the process is killed after step 6 at t=18 (no end record)
    # launch 2 (elastic restart, same launch time) starts at t=20, restores for 2 s, steps 5, 6 re-done (the
    # killed launch's 5, 6 are thrown away by the restart), preempted: end at t=30
    # launch 3 (requeued, launched at t=40) finishes step 7 and ends at t=60
    kept = [
        _step(1, 11),
        _step(2, 12),
        _step(3, 13.5, save_time_s=0.5),
        _step(4, 14.5, eval_time_s=0.25, check_time_s=0.25),
        _step(5, 27, skipped=True),
        _step(6, 28),
        _step(7, 55),
    ]
    discarded = [
        _step(5, 15.5, discarded_by="rollback"),
        _step(6, 16.5, discarded_by="rollback"),
        _step(5, 17, discarded_by="restart"),
        _step(6, 18, discarded_by="restart"),
    ]
    _lines(layout.metrics, kept)
    _lines(layout.metrics_discarded, discarded)
    _lines(layout.anomalies, [{"kind": "rollback", "step": 6, "seconds": 0.5}])
    _lines(
        layout.timeline,
        [
            _start(process=0.5, first_step_at=10, launched=0),
            _start(process=20, first_step_at=26, launched=0, restore=2),
            {"event": "end", "time": 30, "step": 6, "exit_code": 5},
            _start(process=41, first_step_at=54, launched=40, restore=1),
            {"event": "end", "time": 60, "step": 7, "exit_code": 0},
        ],
    )
    found = account(tmp_path)
    assert found.wall_s == 60 and found.launches == 3
    assert found.productive_s == 6  # steps 1-4, 6, 7 (5 was skipped)
    assert found.lost == {
        "start-up": 10 + (26 - 20 - 2) + (54 - 40 - 1),
        "restore": 2 + 1,
        "steps re-done after a failure": 2,
        "rollbacks": 2 + 0.5,
        "skipped steps": 1,
        "checkpoint stalls": 0.5,
        "evaluation": 0.25,
        "checks": 0.25,
        "preflight": 0,
        "between launches": (20 - 18) + (40 - 30),
        "other": 60 - 6 - 48.5,  # the rest of the wall time: no record explains it
    }
    assert list(found.lost) == list(LOSSES)
    assert found.line().startswith("10.0% of 60.0 s wall (6.0 s of productive steps, 3 launches)")
    # each loss where it happened: the spans over wall time
    where = {(s.what, round(s.start, 2)) for s in found.spans}
    assert {
        ("start-up", 0),
        ("rollbacks", 14.5),
        ("steps re-done after a failure", 16),
        ("between launches", 18),
        ("start-up", 20),
        ("between launches", 30),
        ("start-up", 40),
        ("checkpoint stalls", 12),  # after step 2, before step 3
        ("evaluation", 14.75),
    } <= where
    plotted = goodput_series(_records(tmp_path))
    assert plotted["fraction"] == pytest.approx(0.1) and plotted["lost"] == found.lost


def _records(run_dir: Path):
    from keel.tools.report.read import read_run

    return read_run(run_dir)


def test_a_run_without_a_timeline_has_no_goodput_yet(tmp_path):
    _lines(RunDir(tmp_path).metrics, [_step(1, 11)])  # a run from before timelines were written
    assert account(tmp_path) is None
    assert "no timeline.jsonl" in goodput_series(_records(tmp_path)).reason


def test_the_smoothed_loss_is_a_debiased_ema():
    column = {"step": [1, 2, 3, 4], "value": [4.0, None, 2.0, 2.0]}
    got = smoothed(column)
    w = got["weight"]
    assert w == pytest.approx(0.8) and got["step"] == [1, 3, 4]
    assert got["value"][0] == 4.0  # debiased: the first point is itself
    assert got["value"][1] == pytest.approx((w * (1 - w) * 4 + (1 - w) * 2) / (1 - w**2))
    assert smoothed({"step": list(range(10_000)), "value": [1.0] * 10_000})["weight"] == 0.99


# -- a real run through a rollback, a crash and a preemption (one rank) -------------------------------------------
def _keel_train(run_dir: Path, overrides: dict, corpus, cache) -> subprocess.Popen:
    from tests.keel_runs import tiny_overrides

    cmd = [sys.executable, "-m", "keel.launcher.cli", "train", "--nproc", "1"]
    cmd += ["--run-dir", str(run_dir), "--ds-config", str(REPO / "ds_configs/zero1.json")]
    for item in tiny_overrides(corpus, cache, **overrides):
        cmd += ["--set", item]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
    )


@pytest.mark.slow
def test_a_rollback_a_crash_and_a_preemption_each_show_where_they_happened(
    tmp_path, small_corpus, runs
):
    if not Path("/proc").is_dir():
        pytest.skip("finds the rank to preempt through /proc")
    run = tmp_path / "run"
    common = {**SPIKES, "train__steps": 30}
    # launch 1: spikes at 12-14 roll back to 10; crash after step 17 (checkpoint 15 is the newest)
    first = _keel_train(run, {**common, "faults__crash_step": 17}, small_corpus, runs.cache_dir)
    out = first.communicate(timeout=600)[0]
    assert first.returncode == 1, out[-3000:]
    # launch 2: resumes from 15, waits before step 20 to be preempted (SIGUSR1: checkpoint, exit 5)
    go = tmp_path / "go"
    second = _keel_train(
        run,
        {**common, "faults__pause_step": 20, "faults__pause_file": go},
        small_corpus,
        runs.cache_dir,
    )
    deadline = time.monotonic() + 600
    while not go.with_name("go.reached").exists():
        assert second.poll() is None and time.monotonic() < deadline, second.communicate()[0][
            -3000:
        ]
        time.sleep(0.05)
    for pid in rank_pids(second.pid):
        os.kill(pid, signal.SIGUSR1)
    go.touch()
    out = second.communicate(timeout=600)[0]
    assert second.returncode == 5, out[-3000:]
    # launch 3: the requeue finishes
    third = _keel_train(run, common, small_corpus, runs.cache_dir)
    out = third.communicate(timeout=600)[0]
    assert third.returncode == 0, out[-3000:]
    found = account(run)
    assert found.launches == 3 and 0 < found.fraction < 1
    for kind in ("start-up", "rollbacks", "steps re-done after a failure", "between launches"):
        assert found.lost[kind] > 0, (kind, found.lost)
    assert found.lost["checkpoint stalls"] > 0
    # where: the rollback and the crashed launch's lost steps in the first launch, then two gaps between launches
    first_launch_end = min(s.start for s in found.spans if s.what == "between launches")
    for kind in ("rollbacks", "steps re-done after a failure"):
        assert all(s.start < first_launch_end for s in found.spans if s.what == kind), kind
    assert len([s for s in found.spans if s.what == "between launches"]) == 2
    assert len([s for s in found.spans if s.what == "start-up"]) == 3
    assert "- goodput: " in (run / "summary.md").read_text()
    report = write_report(run)
    assert "goodput" in report.drawn and (report.out_dir / "goodput.png").stat().st_size > 0
