"""Asynchronous checkpoints (`checkpoint.async_save`): `Checkpointer.save` in three parts, so training continues
while the files are written.

1. Snapshot, on the main thread at the save's step: `engine.save_checkpoint` runs as in a synchronous save (its
   collectives, ZeRO-3 gathers and tag check included), but each file it hands its checkpoint engine —
   `save(state_dict, path)`, the seam `route_checkpoint_writes` in keel/adapters/deepspeed_internals/ opens — is
   deep-copied into reused host buffers (keel/training/checkpoint/host_snapshot.py) instead of written; where
   DeepSpeed first clones a file's state for torch.save, it clones into those buffers. Plus the rank's RNG file.
   The host holds one extra copy of the rank's checkpoint shard.
2. Write, on one writer thread per rank: first DeepSpeed's other changes to the filesystem, which the snapshot
   deferred (its directories and recovery scripts, through the same seam); then each file by DeepSpeed's own
   `save` into `<tag>/.async_rank<R>/` under the name a synchronous save gives it (torch.save names the zip
   archive inside after the file, so the bytes are the same), hashed (size, chunk sha256s) by a helper thread
   reading the file as it grows, fsynced; then every file is renamed into `<tag>/` and the directory fsynced.
   (Not reniced: a nice writer takes the same CPU time from training, only later, and is starved by other
   processes on a shared host.) A failure is the save's, reported with the path and the errno.
3. Publish, once every rank's writer is done: one 1-int all-reduce per step while a save is pending says when;
   then the synchronous save's verdict (`Checkpointer.finish_save`: one all-gather of each writer's error and
   {file: (size, chunk sha256s)}, rank 0 writes the manifest, `latest` and prunes). A write error anywhere is a failed
   save: nothing is published and rank 0 removes the tag's directory. A crash before the publish leaves
   the directory without its manifest, which is never loaded.

A new save first finishes the previous one; so does the end of the run (the final or preemption save completes
before the process exits), a rollback, and a stop. A failed background save follows `checkpoint.on_save_error`
like a synchronous one (keel/training/checkpoint/save_failures.py); the previous checkpoint stays `latest`.

Why not DeepSpeed's own asynchronous engines (checked in DeepSpeed 0.19.8's runtime/checkpoint_engine/):
`DecoupledCheckpointEngine` hands the live state dict to a subprocess through a torch.multiprocessing queue
(shared tensors, not a snapshot: the next steps' updates race the write) and commits inside the next
`engine.step()` (`_commit_decoupled_checkpoint`, before `_take_model_step`), where Keel's manifest and its
cross-rank verdict cannot run; its `FastCheckpointEngine` writer loads the async_io op (`AsyncIOBuilder`, via
model_checkpointing/writer_factory.py), which reports itself not compatible on this CPU build (no libaio);
`DataStatesCheckpointEngine` needs the external `datastates` package.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from keel.adapters.deepspeed_internals import clones_for_save, route_checkpoint_writes
from keel.parallel import comm
from keel.run_dir import tag_for
from keel.training.checkpoint import rng_state
from keel.training.checkpoint.host_snapshot import HostSnapshot
from keel.training.checkpoint.store import Checkpointer, TrainState
from keel.training.checkpoint.verify import ChunkedSha256
from keel.training.checkpoint.writes import SaveErrors, failure_text

_CHUNK = 8 << 20

log = logging.getLogger("keel")


@dataclass
class WriteReport:
    """One rank's writer, done: `files` maps each file it wrote (relative to the tag's directory) to (size,
    chunk sha256 hex digests); `error` is "" when every file was written."""

    files: dict[str, tuple[int, list[str]]] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0  # the writer's wall time
    # the writer's and its hashing threads' CPU time (what they take from a busy host)
    cpu_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class BackgroundSave:
    """An asynchronous save, concluded on every rank alike (its verdict: `Checkpointer.finish_save`'s)."""

    tag: str
    step: int
    error: str = ""  # why it failed: the first failing rank's error
    snapshot_seconds: float = 0.0  # this rank's snapshot: the time the save kept training waiting
    write_seconds: float = 0.0  # the slowest rank's writer, start to end
    write_cpu_seconds: float = 0.0  # the busiest rank's writer thread, CPU time
    nbytes: int = 0  # the files' total size, all ranks

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class _PlannedFile:
    name: str  # relative to the tag's directory
    state: Any  # the host snapshot to serialize
    save: Callable[
        [Any, str], None
    ]  # DeepSpeed's checkpoint-engine save, or torch.save for Keel's RNG file


@dataclass
class _PlannedChange:
    """Another change DeepSpeed's save makes to the filesystem (a directory, its recovery scripts beside the
    checkpoints), made by the writer before the files."""

    path: str
    change: Callable[[], Any]


@dataclass
class _Pending:
    tag: str
    state: TrainState  # a copy: the loop's own moves on
    guards: dict[str, Any]
    zero_stage: int
    writer: threading.Thread
    snapshot_seconds: float
    report: WriteReport = field(default_factory=WriteReport)


def snapshot_files(
    engine, checkpointer: Checkpointer, tag: str, state: TrainState, snapshot: HostSnapshot
) -> list[_PlannedFile | _PlannedChange]:
    """Every file a synchronous save of `tag` would write on this rank, as host copies, and every other change it
    would make, for the writer (collective: it runs `engine.save_checkpoint`, whose barriers and gathers every rank
    takes)."""
    tag_dir = checkpointer.directory / tag
    planned: list[_PlannedFile | _PlannedChange] = []

    def capture(save: Callable, state_dict: Any, path: str) -> None:
        name = os.path.relpath(path, tag_dir)
        if name.startswith(".."):
            raise RuntimeError(f"DeepSpeed wrote {path}, outside the checkpoint {tag_dir}")
        planned.append(_PlannedFile(name, snapshot.copy(state_dict, name), save))

    def defer(change: Callable[[], Any], path: str) -> None:
        planned.append(_PlannedChange(path, change))

    snapshot.begin()
    with route_checkpoint_writes(engine, capture, defer), clones_for_save(snapshot.clone):
        engine.save_checkpoint(
            str(checkpointer.directory),
            tag=tag,
            client_state=checkpointer.client_state(state),
            save_latest=False,
        )
    rng_name = f"keel_rng_rank{checkpointer.topology.rank}.pt"
    planned.append(
        _PlannedFile(
            rng_name, snapshot.copy(rng_state.capture(engine.module), rng_name), torch.save
        )
    )
    snapshot.wait()
    return planned


def write_files(
    tag_dir: Path,
    rank: int,
    planned: list[_PlannedFile | _PlannedChange],
    before_commit: Callable[[], None] | None = None,
    error: str = "",
) -> WriteReport:
    """Make the planned changes, write the files aside, hash and fsync each, then rename them into `tag_dir` (the
    writer thread's work; `error`: the save already failed on this rank, nothing is written). Never raises: an
    error is the report's."""
    if error:
        return WriteReport(error=error)
    staging = tag_dir / f".async_rank{rank}"
    records: dict[str, tuple[int, str]] = {}
    files = [p for p in planned if isinstance(p, _PlannedFile)]
    hashing_cpu = 0.0
    where: Path | str = staging
    try:
        shutil.rmtree(staging, ignore_errors=True)  # a crashed attempt at this step
        for change in planned:
            if isinstance(change, _PlannedChange):
                where = change.path
                change.change()
        for planned_file in files:
            path = where = staging / planned_file.name
            path.parent.mkdir(parents=True, exist_ok=True)
            # hashes what torch.save has written so far, as it writes
            with _FollowingHash(path) as hashed:
                planned_file.save(planned_file.state, str(path))
            records[planned_file.name] = hashed.record()
            hashing_cpu += hashed.cpu_seconds
        if before_commit is not None:
            before_commit()
        where = tag_dir
        for planned_file in files:
            (tag_dir / planned_file.name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / planned_file.name, tag_dir / planned_file.name)
        _sync_dir(tag_dir)
        shutil.rmtree(staging)
        return WriteReport(records, cpu_seconds=hashing_cpu)
    except Exception as exc:  # noqa: BLE001 - every failure is a failed save, reported to every rank
        shutil.rmtree(staging, ignore_errors=True)
        report = WriteReport(error=f"writing {where}: {failure_text(exc, where)}")
        log.debug("rank %d: checkpoint save failed %s", rank, report.error)
        return report


class _FollowingHash(threading.Thread):
    """The chunk sha256s (keel/training/checkpoint/verify.py) and size of a file another thread is writing, read
    as it grows: torch.save's zip writer writes sequentially (it streams to file objects too), so the hash costs
    no pass of its own after the write. Then the file is fsynced."""

    def __init__(self, path: Path):
        super().__init__(name=f"keel-checkpoint-hash-{path.name}", daemon=True)
        self.path, self.written = path, threading.Event()
        self.digest, self.size, self.error = ChunkedSha256(), 0, None
        self.cpu_seconds = 0.0

    def __enter__(self) -> _FollowingHash:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.written.set()
        self.join()

    def run(self) -> None:
        cpu = time.thread_time()
        try:
            self._follow()
        finally:
            self.cpu_seconds = time.thread_time() - cpu

    def _follow(self) -> None:
        try:
            while not self.path.exists():
                if self.written.wait(0.005) and not self.path.exists():
                    return  # the write failed before creating the file: its own error is reported
            with open(self.path, "rb", buffering=0) as f:
                while True:
                    # read before the read: an empty read then means the end
                    finished = self.written.is_set()
                    chunk = f.read(_CHUNK)
                    if chunk:
                        self.digest.update(chunk)
                        self.size += len(chunk)
                    elif finished:
                        os.fsync(f.fileno())
                        return
                    else:
                        self.written.wait(0.005)
        except OSError as exc:
            self.error = exc

    def record(self) -> tuple[int, list[str]]:
        if self.error is not None:
            raise self.error
        if self.size != self.path.stat().st_size:
            raise RuntimeError(
                f"{self.path}: hashed {self.size} bytes of {self.path.stat().st_size}"
            )
        return self.size, self.digest.hexdigests()


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AsyncCheckpointer:
    """`save` takes the snapshot and starts the writer; `poll` (every step) publishes a save once every rank has
    written it and hands over the outcomes of concluded saves; `finish` waits for the pending one. Every rank
    calls all three at the same steps."""

    def __init__(self, checkpointer: Checkpointer, pin: bool):
        self.checkpointer = checkpointer
        self.control = checkpointer.topology.control("world")
        self.snapshot = HostSnapshot(pin)
        self.pending: _Pending | None = None
        self.concluded: list[BackgroundSave] = []  # not yet handed over by `poll`

    def save(
        self,
        engine,
        state: TrainState,
        guards: dict[str, Any] | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> str:
        """Snapshot `state`'s checkpoint and start writing it (the previous save is finished first: its buffers
        are about to be reused). Returns the tag."""
        self.finish()
        started = time.perf_counter()
        tag = tag_for(state.step)
        rank = self.checkpointer.topology.rank
        begun = SaveErrors(rank)  # rank 0's marking of the tag, before the snapshot's barrier
        tag_dir = self.checkpointer.begin(tag, begun.guard)
        files = snapshot_files(engine, self.checkpointer, tag, state, self.snapshot)

        def write() -> None:
            start, cpu = time.perf_counter(), time.thread_time()
            pending.report = write_files(tag_dir, rank, files, before_commit, begun.error)
            pending.report.seconds = time.perf_counter() - start
            pending.report.cpu_seconds += time.thread_time() - cpu  # plus its hashing thread's

        pending = _Pending(
            tag,
            dataclasses.replace(state),
            copy.deepcopy(guards or {}),
            engine.zero_optimization_stage(),
            threading.Thread(target=write, name=f"keel-checkpoint-writer-{tag}", daemon=True),
            time.perf_counter() - started,
        )
        self.pending = pending
        pending.writer.start()
        return tag

    def writing(self) -> tuple[str | None, bool]:
        """(the pending save's tag, None without one; whether this rank's writer is still writing it): what this
        rank adds to the step's agreement (keel/training/step_gate.py), so that concluding needs no collective."""
        if self.pending is None:
            return None, False
        return self.pending.tag, self.pending.writer.is_alive()

    def poll(self, wait: bool = False, written: str | None = None) -> list[BackgroundSave]:
        """Saves concluded since the last poll. The pending save concludes once the step's agreement found every
        rank's writer done with it (`written`: its tag then; the agreement rides on the step's one all-reduce,
        so polling adds no collective); `wait`: `finish` first."""
        if wait:
            self.finish()
        if self.pending is not None and self.pending.tag == written:
            self._conclude()
        outcomes, self.concluded = self.concluded, []
        return outcomes

    def finish(self) -> None:
        """Wait for the pending save's writers and conclude it (its outcome comes with the next `poll`)."""
        if self.pending is not None:
            self.pending.writer.join()
            self._conclude()

    def _conclude(self) -> None:
        """The writers' verdict through `Checkpointer.finish_save` (the synchronous save's: one all-gather, rank 0
        commits or removes the tag, one broadcast), then one all-gather of the writers' timings."""
        pending, self.pending = self.pending, None
        pending.writer.join()
        report = pending.report
        outcome = self.checkpointer.finish_save(
            pending.tag,
            pending.state,
            report.error,
            report.files,
            pending.guards,
            pending.zero_stage,
        )
        timings = comm.all_gather_object(
            (report.seconds, report.cpu_seconds, sum(size for size, _ in report.files.values())),
            self.control,
        )
        self.concluded.append(
            BackgroundSave(
                pending.tag,
                pending.state.step,
                outcome.error,
                snapshot_seconds=pending.snapshot_seconds,
                write_seconds=max(t[0] for t in timings),
                write_cpu_seconds=max(t[1] for t in timings),
                nbytes=sum(t[2] for t in timings),
            )
        )
