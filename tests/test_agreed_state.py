"""State every rank agrees on, proven with real ranks: the checkpoint a resume loads is rank 0's choice, verified
on every rank (a stale view of the checkpoints stops the run in one line, not a hang or a silent mix of steps),
and a rank that stalls inside a checkpoint save is reported within the save's own watchdog deadline."""

from __future__ import annotations

import shutil
import time

import pytest

from keel.training.checkpoint import EXIT_CHECKPOINT
from keel.training.guards.base import read_anomalies
from keel.training.metrics import read_metrics
from keel.training.watchdog import EXIT_HANG
from tests.keel_runs import Run, copy_run, keel_train
from tests.test_recovery import RESTART

pytestmark = pytest.mark.slow
KEEL_RUNS = [Run.of("restart-ref", 2, "ds_configs/zero1.json", **RESTART)]  # shared with tests/test_recovery.py


def test_rank_with_a_stale_checkpoint_view_stops_every_rank_with_one_line(runs, tmp_path):
    """Rank 1 reads a copy of the checkpoints taken before the last save (its `latest` one save behind, the
    newest step absent): rank 0's choice, step 30, fails rank 1's check and both ranks stop before training."""
    run = copy_run(runs.get("restart-ref", 2, "ds_configs/zero1.json", **RESTART), tmp_path / "run")
    stale = tmp_path / "stale-view"
    shutil.copytree(run / "checkpoints", stale)
    shutil.rmtree(stale / "step00000030")
    (stale / "latest").write_text("step00000025")
    sets = runs.overrides(**{**RESTART, "train__steps": 35, "faults__checkpoint_dir_rank": 1,
                             "faults__checkpoint_dir": stale})
    proc = keel_train(run, 2, sets, "ds_configs/zero1.json", expect_code=EXIT_CHECKPOINT)
    lines = [line for line in proc.stdout.splitlines() if "not whole on every rank" in line]
    assert lines == [f"[keel r0] stopping: checkpoint step00000030 chosen by rank 0 is not whole on every rank — "
                     f"rank 1: {stale}/step00000030/keel_complete.json does not exist; every rank must see the same "
                     "checkpoint directory (a stale or different shared-filesystem view?)"], proc.stdout[-3000:]
    assert [e["kind"] for e in read_anomalies(run)] == ["checkpoint_disagreement"]
    assert "exit code 6" in (run / "summary.md").read_text()
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))  # nothing trained
    # the phases between steps are costs in the metrics: checks every step, each save in the next step's record
    assert all(r["check_time_s"] >= 0 for r in records)
    assert [r["step"] for r in records if "save_time_s" in r] == [6, 11, 16, 21, 26]


def test_rank_stalled_inside_a_save_is_reported_within_the_save_timeout(runs, tmp_path):
    """Rank 1 stalls two minutes inside the step-2 save while rank 0 waits for it in the save's barrier: both
    dump their stacks and exit with the hang code after stability.watchdog_save_timeout, not the stall's end
    (paused, the watchdog would have left rank 0 waiting for the process group's 30-minute timeout)."""
    run = tmp_path / "run"
    sets = runs.overrides(train__steps=4, checkpoint__interval=2, faults__save_stall_rank=1, faults__save_stall_s=120,
                          stability__watchdog_save_timeout=5)
    start = time.monotonic()
    keel_train(run, 2, sets, expect_code=EXIT_HANG)
    assert time.monotonic() - start < 100
    hangs = {e["rank"]: e for e in read_anomalies(run) if e["kind"] == "hang"}
    assert sorted(hangs) == [0, 1]
    for event in hangs.values():
        assert (event["phase"], event["step"], event["timeout_s"]) == ("checkpoint save", 2, 5.0)
        assert event["seconds"] < 5.0 + 10.0
    assert "in during_save" in (run / "stacks" / "rank1-step2.txt").read_text()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert not (run / "checkpoints" / "latest").exists()  # the stalled save never became the latest
