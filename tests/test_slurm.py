"""`keel slurm` on a real SLURM cluster (Debian's slurmctld + two slurmd on 127.0.0.1, started here).

The script's rendering is checked without a cluster; the cluster tests (--slow) submit real jobs: 2 nodes × 2
tasks train to the end with world size 4, and a job signalled with USR1 checkpoints, requeues itself and
finishes with the same losses and weights as an uninterrupted local run on 4 ranks.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from keel.launcher.cli import main
from keel.launcher.slurm import SbatchOptions, parse_time_limit, render
from keel.run_dir import ExitCode
from keel.training.observe.metrics import read_metrics
from tests.keel_runs import REPO, Run, final_weights, losses
from tests.slurm_cluster import SlurmCluster

DS = "ds_configs/zero1.json"
STEPS = 16  # both cluster runs and the local reference: the same config, so the same losses
KEEL_RUNS = [Run.of("slurm-reference", 4, DS, train__steps=STEPS)]
# the preempted run sleeps here (rank 0), so the signal surely lands in the middle of a run
SLEEP_STEP = 6


def keel_slurm(
    run_dir: Path, overrides: list[str], *options: str, env=None
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "keel.launcher.cli",
        "slurm",
        "--run-dir",
        str(run_dir),
        "--ds-config",
        str(REPO / DS),
        *options,
    ]
    for item in overrides:
        cmd += ["--set", item]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def keel_slurm_here(
    capsys, run_dir: Path, overrides: list[str], *options: str
) -> tuple[int, str, str]:
    """`keel slurm` in this process (torch is imported already): exit code, stdout, stderr."""
    argv = ["slurm", "--run-dir", str(run_dir), "--ds-config", str(REPO / DS), *options]
    for item in overrides:
        argv += ["--set", item]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def submit(cluster: SlurmCluster, run_dir: Path, overrides: list[str]) -> str:
    proc = keel_slurm(
        run_dir,
        overrides,
        "--nodes",
        "2",
        "--tasks-per-node",
        "2",
        "--time",
        "00:30:00",
        "--signal-lead",
        "60",
        env=cluster.env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"submitted job (\d+)", proc.stdout)
    assert match, proc.stdout
    return match.group(1)


FAKE_RANK = """#!/bin/bash
# Stands in for `python -m keel.launcher.cli train ... --run-dir DIR` in the script's srun step: it records its
# rank variables, then waits for USR1 or TERM and exits 5 as Keel's ranks do; after a requeue it exits 0. The
# script's own use of the ranks' python (the requeue decision) goes to the real one.
[ "$1 $2" = "-m keel.launcher.slurm_requeue" ] && exec @PYTHON@ "$@"
while [ $# -gt 0 ]; do [ "$1" = --run-dir ] && dir=$2; shift; done
restart=${SLURM_RESTART_COUNT:-0}
echo "$RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR" > "$dir/rank$RANK.restart$restart"
[ "$restart" != 0 ] && exit 0
trap 'echo USR1 >> "$dir/rank$RANK.signal"; exit 5' USR1
trap 'echo TERM >> "$dir/rank$RANK.signal"; exit 5' TERM
touch "$dir/ready$RANK"
while true; do sleep 0.1; done
""".replace("@PYTHON@", sys.executable)


def job_log(run_dir: Path, job_id: str) -> str:
    path = run_dir / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


# -- the script, without a cluster ------------------------------------------------------------------------------
def test_dry_run_renders_a_requeueable_script(runs, tmp_path, capsys):
    code, script, err = keel_slurm_here(
        capsys,
        tmp_path,
        runs.overrides(),
        "--dry-run",
        "--nodes",
        "2",
        "--tasks-per-node",
        "2",
        "--time",
        "01:00:00",
        "--signal-lead",
        "120",
        "--partition",
        "debug",
        "--sbatch=--qos=high",
    )
    assert code == 0, script[-3000:] + err[-3000:]
    assert (tmp_path / "keel.sbatch").read_text() == script
    lines = script.splitlines()
    for line in (
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --time=01:00:00",
        "#SBATCH --partition=debug",
        "#SBATCH --qos=high",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={tmp_path}/slurm-%j.out",
    ):
        assert line in lines, line
    assert not any("--gres" in line for line in lines)  # a CPU job asks for no GPUs
    assert not any("--account" in line for line in lines)
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--ntasks-per-node=2" in srun
    assert "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID" in script
    assert 'scontrol show hostnames "${SLURM_JOB_NODELIST}"' in script and "NodeAddr" in script
    # after the ranks: requeue, resubmit without bad nodes, or end (keel/launcher/slurm_requeue.py)
    assert (
        '"${KEEL_TRAIN[0]}" -m keel.launcher.slurm_requeue' in script
        and "--tasks-per-node 2 --min-nodes 2" in script
        and f"EXIT_PREEMPTED={ExitCode.PREEMPTED}" in script
    )
    assert not any(re.search(r"\bssh\b", line) for line in lines if not line.startswith("#"))
    assert f"--run-dir {tmp_path}" in script and "keel.launcher.cli train" in script
    assert subprocess.run(["bash", "-n", str(tmp_path / "keel.sbatch")]).returncode == 0


def test_render_gpus_and_quoting():
    opts = SbatchOptions(
        nodes=4,
        tasks_per_node=8,
        gpus_per_node=8,
        cpus_per_task=6,
        account="proj",
        job_name="big",
        signal_lead=600,
    )
    cmd = [sys.executable, "-m", "keel.launcher.cli", "train", "--set", "data.corpus=['a b.txt']"]
    script = render(
        (REPO / "slurm" / "keel.sbatch").read_text(),
        opts,
        Path("/shared/runs/big"),
        Path("/shared"),
        cmd,
    )
    lines = script.splitlines()
    for line in (
        "#SBATCH --gres=gpu:8",
        "#SBATCH --cpus-per-task=6",
        "#SBATCH --account=proj",
        "#SBATCH --job-name=big",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --signal=B:USR1@600",
    ):
        assert line in lines, line
    assert not any(line.startswith("#SBATCH --time") for line in lines)  # the partition's default
    # shell-quoted into the KEEL_TRAIN array
    assert "'data.corpus=['\"'\"'a b.txt'\"'\"']'" in script
    array = subprocess.run(
        [
            "bash",
            "-c",
            script.split("KEEL_TRAIN=", 1)[1]
            .split("\n", 1)[0]
            .join(["a=", '; printf "%s\\n" "${a[@]}"']),
        ],
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert array == cmd


@pytest.mark.fault("bad config for a SLURM job", "one line, exit 2, nothing submitted")
def test_config_errors_are_one_line_before_submitting(runs, tmp_path, capsys):
    # 3 ranks cannot split the global batch of 8 into micro-batches of 2: refused before sbatch is looked for
    code, _, err = keel_slurm_here(
        capsys, tmp_path, runs.overrides(), "--nodes", "3", "--tasks-per-node", "1"
    )
    assert code == 2
    assert err.startswith("keel: error:") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "keel.sbatch").exists()
    code, _, err = keel_slurm_here(
        capsys, tmp_path, runs.overrides(), "--time", "5", "--signal-lead", "300"
    )
    assert code == 2 and "--signal-lead" in err


def test_parse_time_limit():
    assert parse_time_limit("30") == 1800
    assert parse_time_limit("30:15") == 1815
    assert parse_time_limit("2:00:00") == 7200
    assert parse_time_limit("1-12") == 36 * 3600
    assert parse_time_limit("1-00:30") == 24 * 3600 + 1800
    assert parse_time_limit("1-00:00:05") == 24 * 3600 + 5


# -- a real cluster --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(runs) -> Path:
    """The uninterrupted run, launched locally on 4 ranks."""
    t0 = time.monotonic()
    run_dir = runs.get("slurm-reference", 4, DS, train__steps=STEPS)
    print(f"\nlocal reference run ({STEPS} steps, 4 ranks): {time.monotonic() - t0:.1f} s")
    return run_dir


@pytest.mark.slow
def test_two_nodes_two_tasks_each(slurm_cluster, runs, reference, tmp_path):
    t0 = time.monotonic()
    job_id = submit(slurm_cluster, tmp_path, runs.overrides(train__steps=STEPS))
    job = slurm_cluster.wait_job(job_id, timeout=400)
    log = job_log(tmp_path, job_id)
    print(f"\nslurm job {job_id} (2 nodes x 2 tasks, {STEPS} steps): {time.monotonic() - t0:.1f} s")
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", f"{job}\n{log[-4000:]}"
    assert job["NumNodes"] == "2" and job["NumTasks"] == "4", job
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(
        range(1, STEPS + 1)
    )
    assert "world=4 " in log, log[-4000:]
    assert "rendezvous 127.0.0.1:" in log  # node1 does not resolve: its NodeAddr
    # the same ranks, data and order as the local launcher
    assert losses(tmp_path) == losses(reference)


@pytest.mark.slow
@pytest.mark.fault(
    "SLURM preemption (SIGUSR1)", "checkpoint, exit 5, requeue, bitwise-exact resume"
)
def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, runs, reference, tmp_path):
    overrides = runs.overrides(
        train__steps=STEPS, faults__sleep_step=SLEEP_STEP, faults__sleep_rank=0, faults__sleep_s=10
    )
    t0 = time.monotonic()
    job_id = submit(slurm_cluster, tmp_path, overrides)
    deadline = time.monotonic() + 300
    while not any(r["step"] >= SLEEP_STEP - 1 for r in read_metrics(tmp_path / "metrics.jsonl")):
        job = slurm_cluster.job(job_id)
        assert job["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), (
            f"{job}\n{job_log(tmp_path, job_id)}"
        )
        assert time.monotonic() < deadline, job_log(tmp_path, job_id)
        time.sleep(0.2)
    signalled = time.monotonic()
    slurm_cluster.run(["scancel", "--signal=USR1", job_id])  # the job's steps: every rank, directly

    job = slurm_cluster.wait_job(job_id, timeout=120, until=lambda j: j["Restarts"] == "1")
    requeued = time.monotonic()
    job = slurm_cluster.wait_job(job_id, timeout=400)
    done = time.monotonic()
    log = job_log(tmp_path, job_id)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", f"{job}\n{log[-5000:]}"

    # The first run stopped after the signalled step with a checkpoint and exit code 5; the second resumed there.
    assert "received SIGUSR1: stopping after this step with a checkpoint" in log, log[-5000:]
    assert f"ranks exited with {ExitCode.PREEMPTED}" in log and "requeueing job" in log
    assert f"job {job_id} restart 1 " in log, log[-5000:]
    assert f"resumed from step{SLEEP_STEP:08d}" in log, log[-5000:]
    assert "ranks exited with 0" in log

    stamps = dict(
        re.findall(r"keel-slurm: (ranks exited with \d+|job \d+ restart \d+) .*?at (\S+)", log)
    )
    gap = (
        datetime.fromisoformat(stamps[f"job {job_id} restart 1"])
        - datetime.fromisoformat(stamps[f"ranks exited with {ExitCode.PREEMPTED}"])
    ).total_seconds()
    print(
        f"\npreempted job {job_id}: signal after {signalled - t0:.1f} s, requeued {requeued - signalled:.1f} s "
        f"later, restarted {gap:.0f} s after the ranks exited, finished {done - t0:.1f} s after submission"
    )

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # bitwise: fp32 on CPU, same world size and data order
    assert losses(tmp_path) == losses(reference)
    ours, theirs = final_weights(tmp_path), final_weights(reference)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.slow
@pytest.mark.fault(
    "SLURM time limit / scancel", "signal reaches every rank; requeued, or cancelled for good"
)
def test_time_limit_signal_is_forwarded_and_scancel_is_final(
    slurm_cluster, runs, tmp_path, capsys, monkeypatch
):
    """The script's own signal handling, with a stand-in for the ranks (no training): USR1 to the batch shell
    (what --signal=B:USR1@lead sends before the time limit) reaches every rank and the job requeues; a plain
    scancel (SIGTERM to the whole job) stops the ranks and the job stays cancelled."""
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_RANK)
    fake.chmod(0o755)
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    jobs = {}
    for mode in ("usr1", "cancel"):  # both at once: 2 x 4 tasks fit on the two 4-CPU nodes
        run_dir = tmp_path / mode
        code, out, err = keel_slurm_here(
            capsys,
            run_dir,
            runs.overrides(),
            "--nodes",
            "2",
            "--tasks-per-node",
            "2",
            "--python",
            str(fake),
        )
        assert code == 0, out + err
        jobs[mode] = (run_dir, re.search(r"submitted job (\d+)", out).group(1))
    deadline = time.monotonic() + 120
    while sum(len(list(run_dir.glob("ready*"))) for run_dir, _ in jobs.values()) < 8:
        assert time.monotonic() < deadline, slurm_cluster.logs()
        time.sleep(0.2)
    slurm_cluster.run(["scancel", "--batch", "--signal=USR1", jobs["usr1"][1]])
    slurm_cluster.run(["scancel", jobs["cancel"][1]])

    run_dir, job_id = jobs["usr1"]
    job = slurm_cluster.wait_job(job_id, timeout=120)
    log = job_log(run_dir, job_id)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", f"{job}\n{log}"
    assert "received SIGUSR1" in log and "requeueing job" in log
    for rank in range(4):
        assert (run_dir / f"rank{rank}.signal").read_text() == "USR1\n"
        for restart in (0, 1):
            assert (run_dir / f"rank{rank}.restart{restart}").read_text().split() == [
                str(rank),
                "4",
                str(rank % 2),
                "127.0.0.1",
            ]
    run_dir, job_id = jobs["cancel"]
    job = slurm_cluster.wait_job(job_id, timeout=120)
    log = job_log(run_dir, job_id)
    assert job["JobState"] == "CANCELLED" and job["Restarts"] == "0", f"{job}\n{log}"
    assert "not requeueing" in log, log
    # every rank was asked to stop (SLURM's TERM, or the script's forwarded USR1 if that came first) and did
    assert all(
        (run_dir / f"rank{rank}.signal").read_text().split()[0] in ("TERM", "USR1")
        for rank in range(4)
    )
    assert not list(run_dir.glob("rank*.restart1"))


def test_the_requeue_counts_only_nodes_a_job_can_be_given(monkeypatch):
    """sinfo's states as the requeue reads them: down, drained, failing and silent (`*`) nodes are not usable; a
    node listed twice (several partitions' rows) is usable if any row says so."""
    from keel.launcher import slurm_requeue

    sinfo = "n1 idle\nn2 alloc\nn3 mix~\nn4 down*\nn5 drain\nn6 idle*\nn7 drng\nn8 comp\nn2 alloc\nn9 fail\n"
    monkeypatch.setattr(
        slurm_requeue.subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, stdout=sinfo, stderr=""),
    )
    nodes = slurm_requeue.partition_nodes("debug")
    assert [n for n, usable in nodes.items() if usable] == ["n1", "n2", "n3", "n8"]
    assert set(nodes) == {f"n{i}" for i in range(1, 10)}
