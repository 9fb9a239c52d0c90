"""Recovery: restart after a killed rank, and resume on a different world size (universal checkpoints)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from keel.training.observe.metrics import read_metrics
from tests.keel_runs import REPO, Run, assert_same_weights, copy_run, keel_train, rank_pids
from tests.test_train_equivalence import assert_close

pytestmark = pytest.mark.slow
RESTART = dict(train__steps=30, checkpoint__interval=5)
FIRST_HALF = dict(train__steps=20, train__exit_after=10)  # stops at step 10 with a checkpoint
KEEL_RUNS = [
    Run.of("zero1-20", 2, "ds_configs/zero1.json", train__steps=20),
    Run.of("zero1-20-first-half", 2, "ds_configs/zero1.json", **FIRST_HALF),
    Run.of("restart-ref", 2, "ds_configs/zero1.json", **RESTART),
]


@pytest.mark.fault("resume on fewer ranks", "universal-checkpoint reshard; same samples and losses")
def test_resume_on_fewer_ranks_reshards_through_a_universal_checkpoint(runs, tmp_path):
    """ZeRO-1 at dp=2 → stop at step 10 → resume at dp=1: DeepSpeed's universal conversion, same global batch
    (gradient accumulation doubles), the same samples, the same losses."""
    straight = runs.get("zero1-20", 2, "ds_configs/zero1.json", train__steps=20)
    resumed = copy_run(
        runs.get("zero1-20-first-half", 2, "ds_configs/zero1.json", **FIRST_HALF),
        tmp_path / "resumed",
    )
    proc = keel_train(resumed, 1, runs.overrides(train__steps=20), "ds_configs/zero1.json")
    assert "converting to a universal checkpoint" in proc.stdout
    assert (resumed / "checkpoints" / "step00000010" / "universal").is_dir()
    got, want = read_metrics(resumed / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    assert [r["consumed_samples"] for r in got] == [r["consumed_samples"] for r in want]
    assert_close([r["loss"] for r in got], [r["loss"] for r in want], 1e-5)


@pytest.mark.fault(
    "rank killed (SIGKILL) mid-run", "world restarted, resumed to bitwise-equal weights"
)
def test_killed_rank_restarts_and_resumes_to_the_same_weights(runs, tmp_path):
    sets = RESTART
    straight = runs.get("restart-ref", 2, "ds_configs/zero1.json", **sets)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "keel.launcher.cli",
        "train",
        "--nproc",
        "2",
        "--run-dir",
        str(run_dir),
        "--max-restarts",
        "2",
        "--ds-config",
        str(REPO / "ds_configs" / "zero1.json"),
    ]
    for item in runs.overrides(**sets):
        cmd += ["--set", item]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 300
    while time.time() < deadline:
        steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
        if steps and steps[-1] >= 12:
            break
        time.sleep(0.2)
    victim = rank_pids(proc.pid)[-1]
    os.kill(victim, signal.SIGKILL)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert "resumed from step" in output
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))
    assert_same_weights(run_dir, straight)
