"""Hang watchdog and straggler monitor: a rank that stops making progress dumps its stacks and exits, so the
launcher can restart the group instead of letting it sit in a collective until the cluster's time limit.

A hang ends the process with `ExitCode.HANG` (the table of every exit code is `keel.run_dir.ExitCode`'s docstring).

A hang is usually transient (a stuck node, a network flap): restarting from the last checkpoint is the cure.

How a hang ends, across ranks. The trainer beats at the start of every step. When one rank hangs (a sleep, a
dead GPU, a deadlock), its peers block in the step's next collective; every rank beat at the start of the same
step within milliseconds of the others, so every rank's watchdog reaches its deadline at about the same moment
and each one dumps its own stacks (the hung rank's show where it is stuck, its peers' show the collective they
wait in) and exits with ExitCode.HANG. torchrun's agent sees the first exit, tears the rest of the group down and
restarts it if it has restarts left. One race is handled explicitly: with gloo, a peer's collective fails as
soon as the hung rank's process is gone, possibly a few milliseconds before that peer's own deadline. An
exception that leaves the watched region (`with watchdog:`) within PEER_WINDOW_S (at most half the timeout) of
the deadline is therefore taken for the hang it is: the rank dumps its stacks plus the exception and exits with
ExitCode.HANG, not 1. With NCCL a dead peer usually does not fail the collective, it just never completes, so the
peers' own deadlines decide. Keep watchdog_timeout below the process group's timeout (DeepSpeed's default is
30 min), or the collective times out first and the rank exits 1.

The work between steps — periodic checks (checksums, loss-outlier gathers), evaluation, checkpoint save and a
rollback's load — runs collectives of its own, which is where a dead peer is most often met; each runs as a
`phase` with its own deadline (stability.watchdog_check/eval/save_timeout), ended the same way as a step's.

Why a Python thread rather than `faulthandler.dump_traceback_later(exit=True)` alone: faulthandler exits with
code 1 (indistinguishable from an exception), records nothing in anomalies.jsonl, and its single timer is
process-global. A Python thread needs the GIL, which every way a training step waits gives up: time.sleep,
gloo and NCCL waits, CUDA synchronization, file and socket I/O. The one case it cannot handle is a thread that
blocks inside C code *while holding the GIL* (a C extension spinning or deadlocked without releasing it): then
no Python thread runs again, and the watchdog thread's wait expires but it never reacquires the GIL to act.
faulthandler's timer is a C thread that dumps the frames without taking the GIL, so it stays as a backstop:
the watchdog thread re-arms it each time it wakes (at least every timeout_s), for timeout_s + BACKSTOP_MARGIN_S.
It therefore only fires when the watchdog thread itself has not run for that long (the GIL case, or the
watchdog's own dump stuck on a dead filesystem); it writes to stderr (the launcher's per-rank log) and exits 1.
A `Timeout (h:mm:ss)!` traceback on stderr before an exit 1 means exactly that.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from keel.run_dir import AnomalyLog, ExitCode, RunDir, node_name

if TYPE_CHECKING:
    from keel.parallel import comm

# the faulthandler backstop fires this long after the watchdog thread last ran
BACKSTOP_MARGIN_S = 60.0
# where a rank waits on its peers: torch's collectives, DeepSpeed's wrappers of them, Keel's own
COLLECTIVE_CODE = tuple(
    os.path.join(*parts)
    for parts in (
        ("torch", "distributed", ""),
        ("deepspeed", "comm", ""),
        ("keel", "parallel", "comm.py"),
    )
)
# torch.distributed code that is no collective: the agent's wrapper at the bottom of a forked rank's stack
NOT_COLLECTIVE_CODE = os.path.join("torch", "distributed", "elastic", "")
PEER_WINDOW_S = 5.0  # an exception this close to the deadline is a peer's hang reaching this rank


class Watchdog:
    """Per-rank heartbeat: a step that runs `timeout_s` seconds without a `beat` dumps every thread's stack to
    `<run_dir>/stacks/rank<R>-step<S>.txt`, records a `hang` anomaly and exits the process with ExitCode.HANG.

    Armed by the first `beat` (setup and checkpoint loading before it are not a step); `phase` gives work between
    beats (checks, evaluation, save) its own deadline; `pause`/`resume` bracket work that is not watched at all
    (the paused time does not count). The exit
    happens on the watchdog thread because the main thread is the one that is stuck. `timeout_s <= 0`: off.
    Use one per process: the faulthandler backstop is process-global.
    """

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        timeout_s: float,
        anomalies: AnomalyLog | None = None,
        backstop: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.anomalies = anomalies if anomalies is not None else AnomalyLog(self.run_dir, rank)
        self.backstop = backstop
        # (step, monotonic start, timeout, what runs: "step" or a phase): one object, so readers see it whole
        self._beat: tuple[int, float, float, str] | None = None
        self._pauses = 0  # nesting depth; written by the main thread only
        self._stop = threading.Event()
        # a phase with an earlier deadline than the one the thread sleeps toward
        self._wake = threading.Event()
        # the watchdog thread and a failing main thread may both try to fire
        self._firing = threading.Lock()
        self._thread: threading.Thread | None = None
        self._watched: int | None = (
            None  # the thread that beats (the trainer's): its stack tells who hung
        )

    # -- the trainer's side ---------------------------------------------------------------------------------
    def start(self) -> Watchdog:
        """Start watching; call it on the thread that will beat."""
        self._watched = threading.get_ident()
        if self.timeout_s > 0 and self._thread is None:
            if self.backstop:
                try:
                    faulthandler.dump_traceback_later(self.timeout_s + BACKSTOP_MARGIN_S, exit=True)
                except (
                    RuntimeError,
                    ValueError,
                    AttributeError,
                    OSError,
                ):  # no stderr file descriptor to write to
                    self.backstop = False
            self._stop.clear()
            self._wake.clear()
            self._thread = threading.Thread(
                target=self._watch, name=f"keel-watchdog-r{self.rank}", daemon=True
            )
            self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """Step `step` starts now. The hot path: one clock read and one attribute store, no lock."""
        self._beat = (step, time.monotonic(), self.timeout_s, "step")

    @contextlib.contextmanager
    def phase(self, name: str, timeout_s: float) -> Iterator[None]:
        """Work between steps watched with its own deadline (`timeout_s` <= 0: paused instead); when it ends the
        step's clock restarts. An exception leaves the phase's deadline in place, so a collective broken by a
        peer's hang near that deadline is still taken for the hang (see `__exit__`)."""
        if timeout_s <= 0 or self._beat is None:
            with self.paused():
                yield
            return
        step = self._beat[0]
        self._beat = (step, time.monotonic(), float(timeout_s), name)
        if timeout_s < self.timeout_s:
            self._wake.set()  # the thread may be sleeping toward the step's later deadline
        yield
        self._beat = (step, time.monotonic(), self.timeout_s, "step")

    def progress(self) -> None:
        """What runs (a step or a phase) moved on: its clock restarts, with the same deadline — for long work
        that reports progress (a checkpoint conversion) rather than taking a step."""
        beat = self._beat
        if beat is not None:
            self._beat = (beat[0], time.monotonic(), beat[2], beat[3])

    def pause(self) -> None:
        self._pauses += 1

    def resume(self) -> None:
        """Restart the clock, so the paused time is not charged to the step. The clock restarts before the
        pause ends: the watchdog thread reads the pause count first, so it never sees an old beat unpaused."""
        if self._pauses == 1 and self._beat is not None:
            self._beat = (self._beat[0], time.monotonic(), *self._beat[2:])
        self._pauses = max(0, self._pauses - 1)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """`with watchdog.paused(): checkpointer.save(...)`"""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._thread = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, Exception) and self._near_deadline():
            self._fire(cause=exc)  # see the module docstring: a collective broken by a peer's hang
        self.stop()

    # -- the watchdog thread --------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.is_set():
            if self.backstop:
                faulthandler.dump_traceback_later(self.timeout_s + BACKSTOP_MARGIN_S, exit=True)
            wait = self.timeout_s
            # pause count first, then the beat (see resume)
            beat = self._beat if self._pauses == 0 else None
            if beat is not None:
                elapsed = time.monotonic() - beat[1]
                if elapsed >= beat[2]:
                    self._fire()
                # this deadline; at least every timeout_s (backstop)
                wait = min(self.timeout_s, beat[2] - elapsed)
            self._wake.wait(wait)
            self._wake.clear()
        if self.backstop:
            faulthandler.cancel_dump_traceback_later()

    def _near_deadline(self) -> bool:
        beat = self._beat if self._pauses == 0 else None
        if self._thread is None or beat is None:
            return False
        return time.monotonic() - beat[1] >= beat[2] - min(PEER_WINDOW_S, beat[2] / 2)

    def _fire(self, cause: BaseException | None = None) -> NoReturn:
        """Dump, record, say so, exit. Every part is best effort: a full disk must not keep a hung rank alive."""
        if not self._firing.acquire(blocking=False):
            while True:  # the other thread is already firing and will end the process
                time.sleep(60)
        # if writing the diagnosis hangs (a dead filesystem), the backstop still exits
        if self.backstop:
            faulthandler.dump_traceback_later(BACKSTOP_MARGIN_S, exit=True)
        step, last, timeout, phase = self._beat or (0, time.monotonic(), self.timeout_s, "step")
        elapsed = time.monotonic() - last
        running = f"step {step}" if phase == "step" else f"{phase} after step {step}"
        what = f"{running} has run {elapsed:.1f} s without a heartbeat (timeout {timeout:g} s)"
        if cause is not None:
            what = (
                f"{running} failed after {elapsed:.1f} s, close to its {timeout:g} s timeout: "
                f"most likely a peer hung ({type(cause).__name__}, below)"
            )
        try:
            path = self._dump_stacks(step, what, cause)
            self.anomalies.record(
                "hang",
                step,
                all_ranks=True,
                phase=phase,
                seconds=round(elapsed, 2),
                timeout_s=timeout,
                pid=os.getpid(),
                stacks=str(path),
                cause=repr(cause) if cause else None,
                waiting=self._waiting_on_peers(cause),
            )
            line = f"keel r{self.rank}: watchdog: {what}; stacks in {path}; exiting with code {ExitCode.HANG}"
        except BaseException as err:  # report, and exit whatever went wrong
            line = (
                f"keel r{self.rank}: watchdog: {what}; writing the diagnosis failed ({err!r}); exiting "
                f"with code {ExitCode.HANG}"
            )
        try:
            print(line + "\n", end="", file=sys.stderr)  # one write: ranks share the pipe
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(ExitCode.HANG)

    def _waiting_on_peers(self, cause: BaseException | None) -> bool:
        """Was this rank waiting on its peers when it fired (its watched thread inside a collective, or a
        collective failed under it: a peer was gone), rather than stuck in its own work? Every rank's answer,
        in its hang record, is what names the rank that hung (keel/run_dir/bad_nodes.py: hang_suspects)."""
        if cause is not None:
            return True
        frame = sys._current_frames().get(self._watched or -1)
        while frame is not None:
            name = frame.f_code.co_filename
            if NOT_COLLECTIVE_CODE not in name and any(part in name for part in COLLECTIVE_CODE):
                return True
            frame = frame.f_back
        return False

    def _dump_stacks(self, step: int, what: str, cause: BaseException | None) -> Path:
        path = RunDir(self.run_dir).hang_stacks(self.rank, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        # faulthandler names threads only by id; this maps the ids to names (MainThread, keel-watchdog-r0, ...)
        threads = "\n".join(f"  0x{t.ident or 0:016x} {t.name}" for t in threading.enumerate())
        # append: a restarted run that hangs at the same step keeps both dumps
        with open(path, "a") as f:
            f.write(
                f"keel watchdog: rank {self.rank} on {node_name()} pid {os.getpid()} at {now}: "
                f"{what}\nthreads:\n{threads}\n\n"
            )
            if cause is not None:
                f.write("the step failed near its deadline with:\n")
                f.write(
                    "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
                    + "\n"
                )
            f.flush()  # faulthandler writes to the file descriptor directly, after what is buffered here
            faulthandler.dump_traceback(f, all_threads=True)
        return path


@dataclass
class StragglerReport:
    line: str  # for the log
    # for metrics.jsonl: step_time_max, step_time_min, slowest_rank, fastest_rank
    metrics: dict[str, float | int]
    host: str = ""  # the slowest rank's node
    # consecutive checks (this one included) at which this node was the slowest by at least the bad spread
    streak: int = 0


# Step times travel as microseconds keyed with the rank, so one MAX all-reduce names both extremes and their ranks
_RANK_BITS = 20  # up to 1,048,576 ranks
_MAX_US = 2**42 - 1  # 50 days


class StragglerMonitor:
    """Every `interval` steps, names the slowest and fastest rank and their step times, in O(1) bytes per rank.

    Over the world group, not data parallel: a slow tensor- or pipeline-parallel rank stalls its whole model
    replica, and a data-parallel group contains only one rank of each replica, so only the world lets every rank
    see the extremes. The cost is one all-reduce (MAX) of two int64s — each an extreme's step time in microseconds
    keyed with its rank — and a broadcast of the slowest rank's host name, every `interval` steps: nothing that
    grows with the world (an all-gather of every rank's time would, and so would keeping it). Collective: every
    rank of the group must call `update` for every step (it communicates only on the interval's steps).

    What to pass: ranks leave every collective together, so whole-step wall times converge and one slow rank
    makes every rank's step slow. The rank that differs is the one that spent the longest *working*, so the
    most telling value is the step time minus the time spent waiting in communication, where the trainer can
    measure it; whole-step times still show the step's spread between ranks and its host.
    """

    def __init__(
        self, control: comm.Group | None = None, interval: int = 50, bad_spread: float = 0.5
    ):
        """`control`: the world's control channel (step times are host values); None: one process.
        `bad_spread`: a check at which the slowest rank is this much slower than the fastest counts towards
        its node's streak (StragglerReport.streak)."""
        self.control = control
        self.interval = interval
        self.bad_spread = bad_spread
        self._streak: tuple[str, int] = ("", 0)  # (node, consecutive slow checks)

    def update(self, step: int, step_time_s: float) -> StragglerReport | None:
        if self.interval <= 0 or step % self.interval:
            return None
        (slow, slow_s), (fast, fast_s), host = self._extremes(step_time_s)
        spread = (slow_s - fast_s) / fast_s if fast_s > 0 else 0.0
        line = (
            f"stragglers: slowest rank {slow} ({host}) {slow_s:.2f} s, "
            f"fastest rank {fast} {fast_s:.2f} s, spread {spread:.0%}"
        )
        if slow != fast and spread >= self.bad_spread:
            node, count = self._streak
            self._streak = (host, count + 1 if node == host else 1)
        else:
            self._streak = ("", 0)
        return StragglerReport(
            line,
            {
                "step_time_max": slow_s,
                "step_time_min": fast_s,
                "slowest_rank": slow,
                "fastest_rank": fast,
            },
            host,
            self._streak[1],
        )

    def _extremes(self, value: float) -> tuple[tuple[int, float], tuple[int, float], str]:
        """((slowest rank, its time), (fastest rank, its time), the slowest rank's host); ties go to the lower
        rank."""
        import torch  # here, not at the top: the watchdog above must stay importable without torch's start-up

        from keel.parallel import comm  # imports torch: here for the same reason

        if self.control is None or not self.control.active:
            return (0, value), (0, value), node_name()
        low = 2**_RANK_BITS - 1
        us = min(max(round(value * 1e6), 0), _MAX_US)
        index = self.control.rank
        keyed = torch.tensor(
            [us << _RANK_BITS | (low - index), (_MAX_US - us) << _RANK_BITS | (low - index)],
            dtype=torch.int64,
        )
        slow_key, fast_key = comm.all_reduce(keyed, self.control, "max").tolist()
        slow_index, fast_index = low - (slow_key & low), low - (fast_key & low)
        host = comm.broadcast_object(node_name(), self.control, src=slow_index)
        ranks = self.control.ranks
        return (
            (ranks[slow_index], (slow_key >> _RANK_BITS) / 1e6),
            (ranks[fast_index], (_MAX_US - (fast_key >> _RANK_BITS)) / 1e6),
            host,
        )
