"""A rank the kernel killed for memory, said in one line with the memory model's figure.

A rank killed by the OOM killer exits on SIGKILL (-9) and torchrun reports only that. The kernel counts its kills:
the launcher reads the count when it starts the ranks and again when one dies on SIGKILL — an increase names
memory. Sources, first readable wins: this process's cgroup (v2 `memory.events`, v1 `memory.oom_control`), then
the whole machine's (`/proc/vmstat`).
"""

from __future__ import annotations

from pathlib import Path

SIGKILL_EXIT = -9  # torch's exit code for a worker killed by SIGKILL


def oom_kills(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> tuple[int, str] | None:
    """(OOM kills counted so far, where): this process's cgroup's count, else the machine's; None if unreadable."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            where = cgroup_root / path.lstrip("/") / "memory.events"
        elif "memory" in controllers.split(","):
            where = cgroup_root / "memory" / path.lstrip("/") / "memory.oom_control"
        else:
            continue
        count = _field(where, "oom_kill")
        if count is not None:
            return count, f"cgroup {where}"
    count = _field(proc / "vmstat", "oom_kill")
    return None if count is None else (count, "/proc/vmstat")


def _field(path: Path, name: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def killed_for_memory(
    exit_codes: dict[int, int], before: tuple[int, str] | None, after: tuple[int, str] | None
) -> str:
    """One line when a rank died on SIGKILL while the kernel's OOM count rose ("" otherwise)."""
    killed = sorted(rank for rank, code in exit_codes.items() if code == SIGKILL_EXIT)
    if (
        not killed
        or before is None
        or after is None
        or after[1] != before[1]
        or after[0] <= before[0]
    ):
        return ""
    ranks = ", ".join(str(r) for r in killed)
    return (
        f"rank {ranks} was killed by the kernel for lack of memory (oom_kill +{after[0] - before[0]} in "
        f"{after[1]})"
    )
