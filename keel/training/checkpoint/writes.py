"""One rank's side of a checkpoint save: every file it writes, hashed as it closes, and a write failure kept.

DeepSpeed writes each shard through its checkpoint engine's `save(state_dict, path)`; `WrittenFiles.seam` routes
those calls through `write` (`route_checkpoint_writes` in keel/adapters/deepspeed_internals/), and Keel's own
files go through `write` too. So this rank knows exactly which files it wrote, and:

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


def failure_text(exc: BaseException) -> str:
    """The root cause of a failed write: torch's zip writer reports an OSError as a RuntimeError about stream
    positions; the OSError it hides (ENOSPC, EDQUOT, EIO) is what the user needs to read."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"[Errno {seen.errno}] {seen.strerror or os.strerror(seen.errno)}"
        seen = seen.__cause__ or seen.__context__
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class WrittenFiles:
    """The files this rank wrote for one checkpoint: their (size, chunk sha256s), or the first write error."""

    def __init__(self, rank: int, disk_room: int | None = None, threads: int = HASH_THREADS):
        self.rank = rank
        self.error = ""
        self._full_disk = disk_room
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="keel-ckpt-hash")
        self._hashes: dict[str, Future] = {}

    @contextlib.contextmanager
    def seam(self, engine) -> Iterator[None]:
        """Inside: every file DeepSpeed's `engine.save_checkpoint` writes goes through `write`."""
        with route_checkpoint_writes(
            engine, lambda save, state, path: self.write(path, lambda t: save(state, t))
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
        except (
            OSError,
            RuntimeError,
        ) as exc:  # torch's writer raises RuntimeError for a failed write
            self.error = f"writing {path}: {failure_text(exc)}"
            log.error("rank %d: checkpoint save failed %s", self.rank, self.error)
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
