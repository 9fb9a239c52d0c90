"""Checkpoint saves that fail on real filesystems, with real ranks: a small tmpfs that is full at the first save or
after two good ones, the checkpoint filesystem remounted read-only mid-run, the checkpoint directory deleted
mid-run, and the job killed with SIGKILL during a synchronous save and during an asynchronous write.

Every run is the shared reference run `restart-ref` (ZeRO-1, two ranks, 30 steps, saved every 5) with one fault;
each run that can go on resumes and must end bitwise at the reference's final weights. Runs that share a world
share a launch (a run a guard stops leaves the world in step): the five filesystem runs in one, the two SIGKILLed
jobs one each, the four resumes in one. Mounting needs root on Linux; elsewhere the tests skip and say so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from keel.launcher.run_spec import build_run, prepare_data, write_run_dir
from keel.run_dir import COMPLETE, read_anomalies
from keel.training.observe.metrics import read_metrics
from tests.keel_runs import REPO, Run, final_weights
from tests.test_recovery import RESTART

ZERO1 = "ds_configs/zero1.json"
REFERENCE = Run.of("restart-ref", 2, ZERO1, **RESTART)  # 30 steps, checkpoints every 5
KEEL_RUNS = [REFERENCE]
# a checkpoint of this run is ~0.7 MB (model states 171 kB, two optimizer shards 252 kB, RNG files): the first
# size holds the run's own files but no checkpoint; the second two checkpoints and DeepSpeed's recovery scripts
TOO_SMALL, TWO_CHECKPOINTS = "400k", "1900k"
PAUSED_AT = 12  # after the saves at 5 and 10, before the one at 15
LAUNCH = (
    "import sys; from pathlib import Path; from keel.launcher.local import launch_local; "
    "sys.exit(launch_local([Path(d) for d in sys.argv[1:]], 2))"
)


class Mounts:
    """tmpfs mounts of a fixed size, unmounted at the end (lazily: a killed job may still hold a file open)."""

    def __init__(self) -> None:
        self.points: list[Path] = []

    def tmpfs(self, where: Path, size: str) -> Path:
        if sys.platform != "linux" or os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root on Linux")
        where.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        self.points.append(where)
        return where

    @staticmethod
    def remount(where: Path, options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)

    def unmount_all(self) -> None:
        for point in reversed(self.points):
            subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _write_run(runs, run_dir: Path, **changes) -> Path:
    spec = build_run(None, runs.overrides(**RESTART, **changes), str(REPO / ZERO1), str(run_dir), 2)
    prepare_data(spec)
    write_run_dir(spec)
    return run_dir


def _launch(
    run_dirs: list[Path],
    log: Path,
    actions: dict[Path, Callable[[], None]] | None = None,
    kill_on: str = "",
) -> int | None:
    """One 2-rank launch training `run_dirs` in turn. `actions`: for a run paused by `faults.pause_file=F`, what
    to do once `F.reached` appears, before F is created. `kill_on`: SIGKILL the whole job once its output shows
    this text (returns None then)."""
    pending = dict(actions or {})
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, *map(str, run_dirs)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    deadline = time.monotonic() + 600
    while proc.poll() is None:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        for release, action in list(pending.items()):
            if release.with_name(release.name + ".reached").exists():
                action()
                release.touch()
                del pending[release]
        if kill_on and kill_on in log.read_text():
            _kill_tree(proc.pid)
            proc.wait()
            return None
        time.sleep(0.05)
    assert not pending, f"the runs never reached {list(pending)}: {log.read_text()[-3000:]}"
    return proc.returncode


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (torch's agent starts each rank in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    family, todo = [], [pid]
    while todo:
        family.append(todo.pop())
        todo += children.get(family[-1], [])
    for member in family:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _complete(run_dir: Path) -> list[str]:
    ckpt = run_dir / "checkpoints"
    return sorted(p.name for p in ckpt.glob("step*") if (p / COMPLETE).is_file())


def _failures(run_dir: Path) -> list[tuple[int, str, str]]:
    return [
        (e["step"], e["action"], e["error"])
        for e in read_anomalies(run_dir)
        if e["kind"] == "checkpoint_save_failed"
    ]


@pytest.fixture(scope="module")
def faulted(runs, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("real-filesystems")
    mounts = Mounts()
    try:
        yield _faulted(runs, root, mounts)
    finally:
        mounts.unmount_all()


def _faulted(runs, root: Path, mounts: Mounts) -> dict:
    reference = runs.run(REFERENCE)
    dirs = {
        "full-first": mounts.tmpfs(root / "small-1", TOO_SMALL) / "run",
        "full-first-stop": mounts.tmpfs(root / "small-2", TOO_SMALL) / "run",
        "full-third": mounts.tmpfs(root / "two-checkpoints", TWO_CHECKPOINTS) / "run",
        "read-only": root / "read-only",
        "deleted": root / "deleted",
    }
    pause = {name: root / f"{name}.go" for name in ("read-only", "deleted")}
    for name, run_dir in dirs.items():
        policy = "stop" if name in ("full-first-stop", "read-only") else "continue"
        paused = (
            {"faults__pause_step": PAUSED_AT, "faults__pause_file": pause[name]}
            if name in pause
            else {}
        )
        _write_run(runs, run_dir, checkpoint__on_save_error=policy, **paused)
    # the read-only run's checkpoints on a filesystem of their own, remounted read-only at step 12
    read_only = mounts.tmpfs(dirs["read-only"] / "checkpoints", "8m")
    actions = {
        pause["read-only"]: lambda: mounts.remount(read_only, "ro"),
        pause["deleted"]: lambda: shutil.rmtree(dirs["deleted"] / "checkpoints"),
    }
    code = _launch(list(dirs.values()), root / "filesystems.log", actions)
    found = {
        "code": code,
        "log": (root / "filesystems.log").read_text(),
        "reference": final_weights(reference),
        **dirs,
    }
    found["complete"] = {name: _complete(run_dir) for name, run_dir in dirs.items()}
    found["failures"] = {name: _failures(run_dir) for name, run_dir in dirs.items()}
    # as the runs left them (a resume writes its own)
    found["summary"] = {n: (d / "summary.md").read_text() for n, d in dirs.items()}
    # SIGKILL while rank 1 stalls inside the save at step 15: after writing its files (sync), or in its writer
    # thread before renaming them into place (async), while training goes on
    for name, changes in (
        ("killed-sync", {}),
        ("killed-async", {"checkpoint__async_save": "true"}),
    ):
        dirs[name] = _write_run(
            runs,
            root / name,
            faults__save_stall_rank=1,
            faults__save_stall_step=15,
            faults__save_stall_s=300,
            **changes,
        )
        killed = _launch([dirs[name]], root / f"{name}.log", kill_on="rank 1 stalls")
        found[f"{name}-code"] = killed
        found["complete"][name] = _complete(dirs[name])
        step15 = dirs[name] / "checkpoints" / "step00000015"
        found[f"{name}-partial"] = sorted(
            p.relative_to(step15).as_posix() for p in step15.rglob("*")
        )
    # the resumes: the disk made larger, the filesystem writable again, the killed jobs restarted
    mounts.remount(dirs["full-third"].parent, "size=16m")
    mounts.remount(read_only, "rw")
    resumed = ["full-third", "read-only", "killed-sync", "killed-async"]
    for name in resumed:
        _write_run(
            runs, dirs[name], **({"checkpoint__async_save": "true"} if "async" in name else {})
        )
    found["resume-code"] = _launch([dirs[n] for n in resumed], root / "resumes.log")
    found["resume-log"] = (root / "resumes.log").read_text()
    found["weights"] = {name: final_weights(dirs[name]) for name in resumed + ["deleted"]}
    found["dirs"] = dirs
    return found


def _bitwise(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> bool:
    return want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow
@pytest.mark.fault(
    "tmpfs full at the first save (real ENOSPC), on_save_error continue or stop",
    "continue: one warning per failed save naming the path and errno, training goes on, the final save's failure "
    "exits 8; stop: exit 8 at once; no traceback",
)
def test_a_full_filesystem_at_the_first_save(faulted):
    log, failures = faulted["log"], faulted["failures"]
    assert "Traceback" not in log and "Connection closed by peer" not in log, log[-3000:]
    go_on = failures["full-first"]
    assert [(step, action) for step, action, _ in go_on] == [
        *((s, "continue") for s in (5, 10, 15, 20, 25)),
        (30, "stop"),
    ]
    run = faulted["full-first"]
    for _, _, error in go_on:
        assert f"writing {run / 'checkpoints' / 'step000000'}" in error, error
        assert "[Errno 28] No space left on device" in error, error
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, 31))
    warning = "step 5: checkpoint step00000005 not saved (rank "
    assert log.count(warning) == 1 and "the run has no complete checkpoint yet" in log
    assert "exit code 8" in (run / "summary.md").read_text()
    stop = faulted["full-first-stop"]
    assert [(s, a) for s, a, _ in failures["full-first-stop"]] == [(5, "stop")]
    assert [r["step"] for r in read_metrics(stop / "metrics.jsonl")][-1] == 5
    assert (
        "checkpoint.on_save_error: stop: stopping with exit code 8"
        in (stop / "summary.md").read_text()
    )
    # the partial checkpoints were removed: the filesystem has its room back
    assert faulted["complete"]["full-first"] == faulted["complete"]["full-first-stop"] == []
    assert not list((run / "checkpoints").glob("step*"))
    assert faulted["code"] == 8


@pytest.mark.slow
@pytest.mark.fault(
    "tmpfs full at a later save, after two good ones (real ENOSPC)",
    "save discarded, the last good checkpoint intact and latest; resumed on a larger disk, bitwise as uninterrupted",
)
def test_a_filesystem_full_after_two_saves_keeps_the_last_good_one(faulted):
    run = faulted["full-third"]
    assert faulted["complete"]["full-third"] == ["step00000005", "step00000010"]
    first = faulted["failures"]["full-third"][0]
    assert first[:2] == (15, "continue") and "[Errno 28]" in first[2]
    assert "the previous checkpoint step00000010 is intact and stays latest" in faulted["log"]
    assert faulted["resume-code"] == 0, faulted["resume-log"][-3000:]
    assert "resumed from step00000010: step 10" in faulted["resume-log"]
    assert (run / "checkpoints" / "latest").read_text() == "step00000030"
    assert _bitwise(faulted["reference"], faulted["weights"]["full-third"])


@pytest.mark.slow
@pytest.mark.fault(
    "checkpoint filesystem remounted read-only mid-run (real EROFS), on_save_error stop",
    "exit 8 in one line naming the path and errno; remounted writable, resumes bitwise",
)
def test_a_filesystem_remounted_read_only(faulted):
    [(step, action, error)] = faulted["failures"]["read-only"]
    run = faulted["read-only"]
    assert (step, action) == (15, "stop") and "[Errno 30] Read-only file system" in error, error
    assert f"writing {run / 'checkpoints' / 'step00000015'}" in error
    summary = faulted["summary"]["read-only"]
    assert "exit code 8" in summary and "step00000010 is intact and stays latest" in summary
    assert faulted["complete"]["read-only"] == ["step00000005", "step00000010"]
    assert _bitwise(faulted["reference"], faulted["weights"]["read-only"])


@pytest.mark.slow
@pytest.mark.fault(
    "checkpoint directory deleted mid-run",
    "warned and recorded; the next save recreates it, the run ends as uninterrupted",
)
def test_a_deleted_checkpoint_directory(faulted):
    run = faulted["deleted"]
    [event] = [e for e in read_anomalies(run) if e["kind"] == "checkpoints_vanished"]
    assert (event["step"], event["checkpoint"]) == (15, "step00000010")
    assert "checkpoint step00000010, saved by this run, is gone from" in faulted["log"]
    assert faulted["failures"]["deleted"] == []
    assert "finished" in (run / "summary.md").read_text()
    assert faulted["complete"]["deleted"] == ["step00000020", "step00000025", "step00000030"]
    assert _bitwise(faulted["reference"], faulted["weights"]["deleted"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.fault(
    "job killed (SIGKILL) during a synchronous save and during an asynchronous write",
    "the half-written save is never loaded; resume from the last complete one ends bitwise as uninterrupted",
)
def test_a_job_killed_during_a_save(faulted, kind):
    name = f"killed-{kind}"
    assert faulted[f"{name}-code"] is None  # killed, not finished
    assert faulted["complete"][name] == ["step00000005", "step00000010"]
    partial = faulted[f"{name}-partial"]
    # rank 1 had written its files (sync) or its staged copies (async) when the job died; nothing was published
    assert partial and COMPLETE not in partial, partial
    if kind == "async":
        assert any(p.startswith(".async_rank1/") for p in partial), partial
    assert "resumed from step00000010: step 10" in faulted["resume-log"]
    assert _bitwise(faulted["reference"], faulted["weights"][name])
