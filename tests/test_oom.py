"""A rank the kernel kills for memory is named so (keel/launcher/oom.py), with the memory model's figure."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.launcher.oom import killed_for_memory, oom_kills
from tests.keel_runs import REPO


def _tree(tmp_path: Path, cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    for name, text in files.items():
        path = (proc if name == "vmstat" else root) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc, root


def test_the_oom_count_comes_from_the_cgroup_v2_v1_or_the_machine(tmp_path):
    v2 = _tree(
        tmp_path / "v2", "0::/job/step\n", {"job/step/memory.events": "low 0\noom 2\noom_kill 3\n"}
    )
    assert oom_kills(*v2) == (3, f"cgroup {v2[1]}/job/step/memory.events")
    v1 = _tree(
        tmp_path / "v1",
        "4:memory:/slurm/job7\n1:cpu:/\n",
        {"memory/slurm/job7/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"},
    )
    assert oom_kills(*v1)[0] == 1
    machine = _tree(tmp_path / "vm", "0::/\n", {"vmstat": "pgfault 9\noom_kill 5\n"})
    assert oom_kills(*machine) == (5, "/proc/vmstat")
    assert oom_kills(tmp_path / "none", tmp_path / "none") is None


def test_only_a_sigkill_with_a_rising_oom_count_is_called_memory():
    where = (4, "cgroup x")
    assert killed_for_memory({0: -9, 1: 1}, where, (5, "cgroup x")) == (
        "rank 0 was killed by the kernel for lack of memory (oom_kill +1 in cgroup x)"
    )
    assert killed_for_memory({0: -9}, where, where) == ""  # a SIGKILL from someone else
    assert killed_for_memory({0: 1}, where, (5, "cgroup x")) == ""  # not a kill
    assert killed_for_memory({0: -9}, None, None) == ""  # unreadable: say nothing rather than guess


def _own_memory_cgroup() -> Path | None:
    """This process's memory cgroup directory, when this machine has cgroup v1's memory controller."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    return None


@pytest.mark.slow
@pytest.mark.fault(
    "a rank killed by the kernel for memory (a 2 GiB cgroup)",
    "one line naming memory and the memory model's figure, not a bare -9",
)
def test_a_rank_the_kernel_kills_for_memory_is_named_so(runs, tmp_path):
    parent = _own_memory_cgroup()
    if parent is None or not os.access(parent, os.W_OK):
        pytest.skip("no writable cgroup v1 memory controller here")
    cgroup = parent / f"keel-oom-{os.getpid()}"
    try:
        cgroup.mkdir()
        (cgroup / "memory.limit_in_bytes").write_text(str(2 << 30))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup: {exc}")
    sets = runs.overrides(
        **{"data.seq_len": 2048, "train.micro_batch_size": 8, "train.global_batch_size": 16},
        model__dim=256,
        train__steps=2,
    )
    cmd = [sys.executable, "-m", "keel.launcher.cli", "train", "--nproc", "2"]
    cmd += ["--run-dir", str(tmp_path / "run"), "--ds-config", str(REPO / "ds_configs/zero0.json")]
    for item in sets:
        cmd += ["--set", item]
    try:
        proc = subprocess.run(
            ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *cmd],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
        )
    finally:
        for _ in range(50):  # the cgroup goes once its last process has left
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "was killed by the kernel for lack of memory (oom_kill +" in proc.stderr, proc.stderr[
        -3000:
    ]
    assert "the memory model puts each rank at" in proc.stderr
    print("\n" + next(line for line in proc.stderr.splitlines() if "lack of memory" in line))
