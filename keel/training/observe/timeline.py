"""Where a run's wall time goes between launches: `<run_dir>/timeline.jsonl`, written by rank 0.

Each process that trains the run (the first launch, an elastic restart, a SLURM requeue) appends one `start` record
once its first step is done — when the process started, when `keel train` launched the job, and the seconds of
each start-up phase (imports, rendezvous, process groups, data, reshard, engine, restore, first step) — and one
`end` record when it ends on its own (a killed process writes none: its end is its last step's). Goodput is read
off these and the metrics (keel/run_dir/goodput.py); bench/startup.py reads the phases.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from keel.run_dir import RunDir

LAUNCHED_AT = "KEEL_LAUNCHED_AT"  # set by `keel train` for the ranks it starts: the job's own start


def process_started() -> float:
    """This process's start (wall clock): from /proc on Linux, so the interpreter's start-up and imports count;
    elsewhere, now."""
    try:
        since_boot = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + since_boot / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StartupClock:
    """The start-up phases of one run in this process, measured from `since`: the process start (the time before
    the first phase is the imports), or the end of the previous run trained in the same process. Time between
    phases is `other`. Each phase's start also notes the process's resident memory, and the file-backed part of it
    (library code and mapped files, which the kernel reclaims before it kills): what the engine and the steps add is
    read above the figures at the engine's start."""

    def __init__(self, since: float, before: str = "imports"):
        self.since = since
        self.phases: dict[str, float] = {}
        self.resident: dict[str, float] = {}  # GiB at each phase's start
        self.resident_file: dict[str, float] = {}  # of which file-backed
        self._mark, self._gap = since, before

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.time()
        resident, file_backed = resident_gib(), resident_gib("RssFile")
        if resident is not None:
            self.resident.setdefault(name, round(resident, 4))
        if file_backed is not None:
            self.resident_file.setdefault(name, round(file_backed, 4))
        self._add(self._gap, start - self._mark)
        self._gap = "other"
        try:
            yield
        finally:
            self._mark = time.time()
            self._add(name, self._mark - start)

    def _add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + max(0.0, seconds)

    def record(self, step: int, first_step_started: float, first_step_s: float) -> dict[str, Any]:
        """The `start` record, once the first step (`step`: started at `first_step_started`, `first_step_s`
        long) is done."""
        self._add(self._gap, first_step_started - self._mark)
        self._add("first step", first_step_s)
        launched = os.environ.get(LAUNCHED_AT)
        return {
            "event": "start",
            "time": time.time(),
            "process_started": self.since,
            "launched_at": float(launched) if launched else None,
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "requeue": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            "step": step,
            "first_step_at": first_step_started,
            "phases": {k: round(v, 4) for k, v in self.phases.items()},
            "resident_gib": self.resident,
            "resident_file_gib": self.resident_file,
        }


def resident_gib(part: str = "VmRSS") -> float | None:
    """This process's resident memory now (Linux, `/proc/self/status`), None elsewhere: `VmRSS` all of it,
    `RssFile` its file-backed part (library code paged in as it first runs, and mapped files, which the kernel
    reclaims before it kills); the rest is anonymous, what the process allocated."""
    try:
        with open("/proc/self/status") as status:
            kib = next(int(line.split()[1]) for line in status if line.startswith(f"{part}:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return kib / 2**20


def append(run_dir: Path, record: dict[str, Any]) -> None:
    """One line appended (rank 0): whole lines, so a reader never sees half of one."""
    with open(RunDir(run_dir).timeline, "a") as f:
        f.write(json.dumps(record) + "\n")


def end_record(step: int, exit_code: int) -> dict[str, Any]:
    return {"event": "end", "time": time.time(), "step": step, "exit_code": int(exit_code)}
