"""One rank's side of a checkpoint save: every file it writes, hashed as it closes, and a write failure kept.

DeepSpeed writes each shard through its checkpoint engine's `save(state_dict, path)`; `WrittenFiles.seam` routes
those calls through `write`, and every other change DeepSpeed's save makes to the filesystem (its directories, the
recovery scripts it copies beside the checkpoints) through `guard` (`route_checkpoint_writes` in
keel/adapters/deepspeed_internals/). Keel's own files and directories go through the same two. So no write of a
save escapes, this rank knows exactly which files it wrote, and:

- each is hashed (size + the sha256 of each chunk, keel/training/checkpoint/verify.py) on a small thread pool
  as soon as it is closed, overlapping the next write while its bytes are still in the page cache; the hashes
  reach rank 0's manifest through the save's one gather (keel/training/checkpoint/store.py
  `Checkpointer.finish_save`), so nobody re-reads the checkpoint to describe it;
- a write that fails (disk full, quota, I/O error) is *kept*, not raised: DeepSpeed's save ends in a collective
  barrier, and a rank that raised would skip it and hang its peers. The rank writes nothing more for this save,
  goes on through DeepSpeed's barrier, and reports the error in the same all-gather; every rank then discards
  the save together (`on_save_error` decides what the run does, keel/training/checkpoint/save_failures.py).

`disk_room` rehearses a full disk inside DeepSpeed's own shard write (`faults.save_enospc_*`, through
keel/training/faults.py): the rank's first file of the save takes that many bytes and then fails with ENOSPC, as a
full filesystem would.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from keel.adapters.deepspeed_internals import route_checkpoint_writes
from keel.training.checkpoint.verify import describe

HASH_THREADS = 2
log = logging.getLogger("keel")


class FullDisk(io.RawIOBase):
    """A file that takes `room` bytes and then fails like a full filesystem (ENOSPC)."""

    def __init__(self, path: str | os.PathLike, room: int):
        super().__init__()
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._room = room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self._room <= 0:
            raise OSError(
                errno.ENOSPC, "No space left on device (injected: faults.save_enospc_rank)"
            )
        data = memoryview(data).cast("B")[: self._room]
        written = self._file.write(data)
        self._room -= written
        return written

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def failure_text(exc: BaseException, path: str | os.PathLike | None = None) -> str:
    """The root cause of a failed write of `path`: the OSError (ENOSPC, EDQUOT, EROFS, EIO) is what the user needs
    to read. torch's zip writer reports a failed write to a path as a RuntimeError about stream positions, with the
    errno lost in C++; then the filesystem under `path` is asked: read-only, or no space left."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"[Errno {seen.errno}] {seen.strerror or os.strerror(seen.errno)}"
        seen = seen.__cause__ or seen.__context__
    found = _filesystem_state(Path(path)) if path is not None else None
    if found is not None:
        return found
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _filesystem_state(path: Path) -> str | None:
    """What keeps files from being written under `path` now (read-only, full), as an errno line; None: nothing."""
    where = next((p for p in (path, *path.parents) if p.exists()), None)
    try:
        stat = os.statvfs(where) if where is not None else None
    except OSError:
        return None
    if stat is None:
        return None
    if stat.f_flag & os.ST_RDONLY:
        return f"[Errno {errno.EROFS}] {os.strerror(errno.EROFS)} (the filesystem is mounted read-only)"
    if stat.f_bavail == 0:
        return f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} (the filesystem is full)"
    return None


class SaveErrors:
    """A rank's first failure in one checkpoint save, kept (not raised) until the save's verdict."""

    def __init__(self, rank: int):
        self.rank = rank
        self.error = ""

    def guard(self, change: Callable[[], Any], path: str | os.PathLike) -> None:
        """Make a filesystem `change` to `path` that is part of this save but not a file to hash (a directory,
        a marker, a copied script): a failure is kept like a failed write; after one, nothing more is changed."""
        if self.error:
            return
        try:
            change()
        except OSError as exc:
            self.fail(path, exc)

    def fail(self, path: str | os.PathLike, exc: BaseException) -> None:
        """Keep `exc`, raised writing `path`: the file the OSError names where it names one (a copy's or a
        rename's destination, a directory made) is the more precise path."""
        if isinstance(exc, OSError):
            path = exc.filename2 or exc.filename or path
        self.error = f"writing {path}: {failure_text(exc, path)}"
        # the save's verdict names the first failing rank's error on rank 0; each rank's own, in its debug log
        log.debug("rank %d: checkpoint save failed %s", self.rank, self.error)


class WrittenFiles(SaveErrors):
    """The files this rank wrote for one checkpoint: their (size, chunk sha256s), or the first write error."""

    def __init__(self, rank: int, disk_room: int | None = None, threads: int = HASH_THREADS):
        super().__init__(rank)
        self._full_disk = disk_room
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="keel-ckpt-hash")
        self._hashes: dict[str, Future] = {}

    @contextlib.contextmanager
    def seam(self, engine) -> Iterator[None]:
        """Inside: every file DeepSpeed's `engine.save_checkpoint` writes goes through `write`, and every other
        change it makes to the filesystem (directories, its recovery scripts) through `guard`."""
        with route_checkpoint_writes(
            engine, lambda save, state, path: self.write(path, lambda t: save(state, t)), self.guard
        ):
            yield

    def write(self, path: str | os.PathLike, write: Callable[[Any], None]) -> None:
        """`write(target)` the file at `path` (target: the path, or a file object standing in for it), then hash
        it in the background; a failure is kept on the rank (see the module docstring)."""
        # this save already failed here: write nothing more, let DeepSpeed reach its barrier
        if self.error:
            return
        path = Path(path)
        try:
            if self._full_disk is not None:
                room, self._full_disk = self._full_disk, None
                log.warning(
                    "fault injection: rank %d's disk fills after %d bytes of %s",
                    self.rank,
                    room,
                    path.name,
                )
                with FullDisk(path, room) as target:
                    write(target)
            else:
                write(path)
        # torch's zip writer raises RuntimeError for a failed write
        except (OSError, RuntimeError) as exc:
            self.fail(path, exc)
            return
        self._hashes[path.name] = self._pool.submit(describe, path)

    def result(self) -> tuple[str, dict[str, tuple[int, list[str]]]]:
        """(the first error or "", {file name: (size, chunk sha256s)}) once every hash is done."""
        files = {}
        for name, future in self._hashes.items():
            try:
                files[name] = future.result()
            except OSError as exc:  # the file vanished or became unreadable right after its write
                self.error = self.error or f"hashing {name}: {failure_text(exc)}"
        self._pool.shutdown()
        return self.error, ({} if self.error else files)
