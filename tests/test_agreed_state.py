"""State every rank agrees on, proven with real ranks: the checkpoint a resume loads is rank 0's choice, verified
on every rank (a stale view of the checkpoints stops the run in one line, not a hang or a silent mix of steps),
and a rank that stalls inside a checkpoint save is reported by the save's own watchdog deadline, not at the
stall's end. How soon is a time, measured by `python bench/hang_detection.py --phase save`, not asserted here.

Both runs end early, so they share one launch of their own (the world trains run dirs one after another,
keel/training/entry.py `run_sequence`): the stale-view run stops with exit code 6 and the world goes on to the
stalled-save run, whose hang then ends the processes with exit code 4.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys

import pytest

from keel.launcher.run_spec import build_run, prepare_data, write_run_dir
from keel.run_dir import ExitCode, read_anomalies
from keel.training.observe.metrics import read_metrics
from keel.training.observe.watchdog import PEER_WINDOW_S
from tests.keel_runs import REPO, ZERO0, Run, copy_run
from tests.test_recovery import RESTART

pytestmark = pytest.mark.slow
KEEL_RUNS = [
    Run.of("restart-ref", 2, "ds_configs/zero1.json", **RESTART)
]  # shared with tests/test_recovery.py
STALL_S, SAVE_TIMEOUT_S = 120, 5


@pytest.fixture(scope="module")
def stopped(runs, tmp_path_factory) -> dict:
    """Rank 1 reads a copy of restart-ref's checkpoints taken before its last save (`latest` one save behind,
    step 30 absent) while resuming it to step 35; then a fresh run whose rank 1 stalls inside the step-2 save."""
    root = tmp_path_factory.mktemp("agreed")
    stale_run = copy_run(
        runs.get("restart-ref", 2, "ds_configs/zero1.json", **RESTART), root / "stale-run"
    )
    stale = root / "stale-view"
    shutil.copytree(stale_run / "checkpoints", stale)
    shutil.rmtree(stale / "step00000030")
    (stale / "latest").write_text("step00000025")
    stall_run = root / "stall-run"
    plans = [
        (
            stale_run,
            "ds_configs/zero1.json",
            {
                **RESTART,
                "train__steps": 35,
                "faults__checkpoint_dir_rank": 1,
                "faults__checkpoint_dir": stale,
            },
        ),
        (
            stall_run,
            ZERO0,
            dict(
                train__steps=4,
                checkpoint__interval=2,
                faults__save_stall_rank=1,
                faults__save_stall_s=STALL_S,
                stability__watchdog_save_timeout=SAVE_TIMEOUT_S,
            ),
        ),
    ]
    for run_dir, ds_config, changes in plans:
        spec = build_run(None, runs.overrides(**changes), str(REPO / ds_config), str(run_dir), 2)
        prepare_data(spec)
        write_run_dir(spec)
    code = (
        "import sys; from pathlib import Path; from keel.launcher.local import launch_local; "
        "sys.exit(launch_local([Path(d) for d in sys.argv[1:]], 2))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(stale_run), str(stall_run)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    return {"proc": proc, "stale_run": stale_run, "stale": stale, "stall_run": stall_run}


@pytest.mark.fault("rank sees a stale checkpoint directory", "every rank stops in one line; exit 6")
def test_rank_with_a_stale_checkpoint_view_stops_every_rank_with_one_line(stopped):
    """Rank 0's choice, step 30, fails rank 1's check: both ranks stop before building an engine."""
    proc, run, stale = stopped["proc"], stopped["stale_run"], stopped["stale"]
    lines = [line for line in proc.stdout.splitlines() if "not whole on every rank" in line]
    assert lines == [
        f"[keel r0] stopping: checkpoint step00000030 chosen by rank 0 is not whole on every rank — "
        f"rank 1: {stale}/step00000030/keel_complete.json does not exist; every rank must see the same "
        "checkpoint directory (a stale or different shared-filesystem view?)"
    ], proc.stdout[-3000:]
    assert [e["kind"] for e in read_anomalies(run)] == ["checkpoint_disagreement"]
    assert f"exit code {ExitCode.CHECKPOINT}" in (run / "summary.md").read_text()
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))  # nothing trained
    # the phases between steps are costs in the metrics: checks every step, each save in the next step's record;
    # a clock around code that ran reads a finite, positive time (a phase skipped or a broken clock would not)
    assert all(
        isinstance(r.get("check_time_s"), float)
        and math.isfinite(r["check_time_s"])
        and r["check_time_s"] > 0
        for r in records
    ), [r.get("check_time_s") for r in records]
    assert [r["step"] for r in records if "save_time_s" in r] == [6, 11, 16, 21, 26]


@pytest.mark.fault(
    "rank stalls inside a checkpoint save", "stacks dumped, exit 4 within the save timeout"
)
def test_rank_stalled_inside_a_save_is_reported_within_the_save_timeout(stopped):
    """Rank 1 stalls inside the step-2 save while rank 0 waits for it in the save's barrier: both dump their
    stacks and exit with the hang code after stability.watchdog_save_timeout, not at the stall's end (paused, the
    watchdog would have left rank 0 waiting for the process group's 30-minute timeout).

    Ended by the deadline, not by the stall: had the stall ended (STALL_S), the save would have completed and the
    run trained on to step 4 and exited 0; here it exits with the hang code, its metrics stop at step 2, the save
    never became `latest`, and rank 1's stacks were dumped while it was still inside the stall (`during_save`).
    How many seconds that took is bench/hang_detection.py's (`--phase save`), not a bound here."""
    proc, run = stopped["proc"], stopped["stall_run"]
    assert proc.returncode == ExitCode.HANG, proc.stdout[-3000:] + proc.stderr[-3000:]
    hangs = {e["rank"]: e for e in read_anomalies(run) if e["kind"] == "hang"}
    assert sorted(hangs) == [0, 1]
    for event in hangs.values():
        assert (event["phase"], event["step"], event["timeout_s"]) == (
            "checkpoint save",
            2,
            SAVE_TIMEOUT_S,
        )
        # not before the deadline: a watchdog fires at it, or (a peer's collective broken by the hung rank's
        # exit) within PEER_WINDOW_S of it; 0.01 for the anomaly's rounding to 2 decimals
        assert event["seconds"] >= SAVE_TIMEOUT_S - min(PEER_WINDOW_S, SAVE_TIMEOUT_S / 2) - 0.01, (
            event
        )
    assert "in during_save" in (run / "stacks" / "rank1-step2.txt").read_text()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert not (run / "checkpoints" / "latest").exists()  # the stalled save never became the latest
