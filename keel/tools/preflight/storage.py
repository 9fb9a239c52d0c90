"""The checkpoint directory: write and read bandwidth (fsync'd, read back cold and verified) and free space.

Every rank writes at once, as every rank does when a checkpoint is saved. The file is fsync'd before the write
clock stops, its pages are dropped from the page cache before it is read back (posix_fadvise DONTNEED, where the
platform has it), and the bytes read must be the bytes written. Free space is judged against what the run will
need: pruning removes the oldest checkpoint only after a new one has committed, so keep_last + 1 checkpoints
exist at the peak; checkpoints already in the directory count towards them.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PROBE_BYTES = 16 << 20
CHUNK = 4 << 20


@dataclass(frozen=True)
class StorageResult:
    directory: str
    write_mbps: float
    read_mbps: float
    verified: bool  # the bytes read back were the bytes written
    free_bytes: int


def existing_dir(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (the checkpoint dir of a new run does not yet)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path, fake: int = -1) -> int:
    """Bytes this user may still write under `path`; `fake` >= 0 is faults.preflight_free_bytes."""
    if fake >= 0:
        return fake
    stat = os.statvfs(existing_dir(path))
    return stat.f_bavail * stat.f_frsize


def measure_storage(
    directory: Path, rank: int, fake_free: int = -1, size: int = PROBE_BYTES
) -> StorageResult:
    directory.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(rank).bytes(size)
    path = directory / f".preflight-rank{rank}-{os.getpid()}.tmp"
    try:
        start = time.perf_counter()
        with open(path, "wb") as f:
            for offset in range(0, size, CHUNK):
                f.write(data[offset : offset + CHUNK])
            f.flush()
            os.fsync(f.fileno())
        written = time.perf_counter() - start
        with open(path, "rb") as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            read_back = hashlib.sha256()
            while chunk := f.read(CHUNK):
                read_back.update(chunk)
            read = time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)
    return StorageResult(
        str(directory),
        size / written / 1e6,
        size / read / 1e6,
        read_back.digest() == hashlib.sha256(data).digest(),
        free_bytes(directory, fake_free),
    )


def directory_bytes(directory: Path) -> int:
    """Bytes of the files under `directory` (the checkpoints already there)."""
    if not directory.is_dir():
        return 0
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
