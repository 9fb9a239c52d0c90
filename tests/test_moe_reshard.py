"""An MoE run resumes on another data/expert-parallel layout: experts and their Adam state move to the ranks that
hold them now (keel/training/checkpoint/moe_reshard.py), and training continues as if uninterrupted."""

from __future__ import annotations

import re
import time

import pytest

from keel.training.observe.metrics import read_metrics
from tests.keel_runs import Run, copy_run, keel_train
from tests.test_train_equivalence import assert_close

pytestmark = pytest.mark.slow
MOE = dict(model__moe_experts=4, parallel__ep=2, train__steps=20)
KEEL_RUNS = [
    Run.of("moe-ep2edp2-20", 4, "ds_configs/zero1.json", **MOE),
    Run.of("moe-ep2edp2-first-half", 4, "ds_configs/zero1.json", train__exit_after=10, **MOE),
]


def _records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}


@pytest.mark.fault(
    "a node lost under an MoE run (4 ranks ep2 x edp2 resume on 2: ep2 x edp1, ep1 x edp2)",
    "experts and their Adam state converted to the new layout; the run continues as uninterrupted",
)
@pytest.mark.parametrize("ep", [2, 1])
def test_moe_resumes_on_fewer_ranks_and_another_ep(runs, tmp_path, ep):
    straight = _records(runs.get("moe-ep2edp2-20", 4, "ds_configs/zero1.json", **MOE))
    first = runs.get(
        "moe-ep2edp2-first-half", 4, "ds_configs/zero1.json", train__exit_after=10, **MOE
    )
    resumed = copy_run(first, tmp_path / "resumed")
    proc = keel_train(
        resumed, 2, runs.overrides(**{**MOE, "parallel__ep": ep}), "ds_configs/zero1.json"
    )
    assert "converting to a universal checkpoint" in proc.stdout + proc.stderr
    got = _records(resumed)
    assert sorted(got) == list(range(1, 21))
    assert [got[s]["consumed_samples"] for s in range(11, 21)] == [
        straight[s]["consumed_samples"] for s in range(11, 21)
    ]
    assert_close(
        [got[s]["loss"] for s in range(11, 21)], [straight[s]["loss"] for s in range(11, 21)], 1e-5
    )
    converted = resumed / "checkpoints" / "step00000010" / "universal_moe" / f"ep{ep}"
    assert sorted(p.name for p in converted.iterdir()) == [f"tp0_ep{e}" for e in range(ep)]


@pytest.mark.fault(
    "an MoE job on one node fewer, preempted by SLURM (USR1) after resharding",
    "experts converted on the new layout; checkpoint, exit 5, requeue, resume; as uninterrupted",
)
def test_moe_resumes_on_one_node_through_the_slurm_requeue_path(slurm_cluster, runs, tmp_path):
    """The 4-rank ep2 x edp2 run's checkpoint at step 10, resubmitted with `keel slurm` on one node of 2 tasks at
    ep1: the job converts the experts, trains, is preempted at step 14 (USR1: checkpoint, exit 5), is requeued by
    its script and finishes from its own checkpoint, with the uninterrupted 4-rank run's samples and losses."""
    from tests.test_slurm import job_log, keel_slurm

    straight = _records(runs.get("moe-ep2edp2-20", 4, "ds_configs/zero1.json", **MOE))
    first = runs.get(
        "moe-ep2edp2-first-half", 4, "ds_configs/zero1.json", train__exit_after=10, **MOE
    )
    run_dir = copy_run(first, tmp_path / "moe")
    overrides = runs.overrides(
        **{**MOE, "parallel__ep": 1},
        faults__sleep_step=14,
        faults__sleep_rank=0,
        faults__sleep_s=10,
    )
    proc = keel_slurm(
        run_dir,
        overrides,
        "--nodes",
        "1",
        "--tasks-per-node",
        "2",
        "--time",
        "00:30:00",
        "--signal-lead",
        "60",
        env=slurm_cluster.env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    deadline = time.monotonic() + 300
    while not any(r["step"] >= 13 for r in read_metrics(run_dir / "metrics.jsonl")):
        job = slurm_cluster.job(job_id)
        assert job["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), (
            f"{job}\n{job_log(run_dir, job_id)}"
        )
        assert time.monotonic() < deadline, job_log(run_dir, job_id)
        time.sleep(0.2)
    slurm_cluster.run(["scancel", "--signal=USR1", job_id])
    job = slurm_cluster.wait_job(job_id, timeout=400)
    log = job_log(run_dir, job_id)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", f"{job}\n{log[-5000:]}"
    assert "converting to a universal checkpoint" in log and "received SIGUSR1" in log, log[-5000:]
    resumed = re.findall(r"resumed from step(\d+)", log)
    assert resumed[0] == "00000010" and int(resumed[-1]) >= 14, resumed
    got = _records(run_dir)
    assert sorted(got) == list(range(1, 21))
    assert [got[s]["consumed_samples"] for s in range(11, 21)] == [
        straight[s]["consumed_samples"] for s in range(11, 21)
    ]
    assert_close(
        [got[s]["loss"] for s in range(11, 21)], [straight[s]["loss"] for s in range(11, 21)], 1e-5
    )
