"""Checkpoint contents against the manifest: every file's size and sha256, read once across the world.

A checkpoint whose completion marker exists can still be bad: a shard cut short by a full disk or a dying node,
flipped bytes on a failing drive, a rank file deleted by hand. DeepSpeed would load most of these silently and
the run would go non-finite a few steps later, blaming its data. So `keel_complete.json` records each file's
size and the sha256 of each of its `CHUNK_HASH_BYTES` chunks (hashed by the rank that wrote it,
keel/training/checkpoint/writes.py), and a load verifies them: the chunks of every file are the pieces of work,
each rank hashes a byte-balanced share of them (`shares`) on a few threads, so the checkpoint is read once in
total whatever the world size, and one large file (a pipeline stage's weights, 10+ GB at 70B) is read by many
ranks in parallel rather than by one thread. The verdicts meet in rank 0
(keel/training/checkpoint/store.py `Checkpointer.agree_on`). Older manifests verify as they were written: a
whole-file sha256 (one piece per file), or sizes only.

A bad checkpoint is never deleted: `set_aside` renames it `stepN.corrupt` (kept for a post-mortem, no longer a
checkpoint: discovery and pruning only see `stepNNNNNNNN` names).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import mmap
import os
from collections.abc import Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

# bytes read per update: hashlib releases the GIL on buffers this size, so threads overlap
CHUNK = 8 << 20
# bytes per manifest hash: the unit of verification work one rank takes
CHUNK_HASH_BYTES = 256 << 20
VERIFY_THREADS = 4
CORRUPT_SUFFIX = ".corrupt"
Key = TypeVar("Key", bound=Hashable)


@dataclass(frozen=True)
class Entry:
    """One file as the manifest records it."""

    size: int
    sha256: str | None = None  # the whole file's (manifests written before chunk hashes)
    chunks: tuple[str, ...] | None = None  # each `chunk_bytes` of the file's, the last one shorter
    chunk_bytes: int = CHUNK_HASH_BYTES


@dataclass(frozen=True, order=True)
class Piece:
    """One unit of verification: bytes [start, start + length) of a file and their sha256 (None: the size only;
    length -1: the whole file, hashed whole)."""

    name: str
    start: int = 0
    length: int = -1
    sha256: str | None = None


def sha256_of(path: Path, start: int = 0, length: int = -1) -> str:
    """sha256 of `length` bytes of `path` from `start` (-1: to the end)."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    left = length if length >= 0 else float("inf")
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while left > 0 and (n := f.readinto(view[: int(min(CHUNK, left))])):
            digest.update(view[:n])
            left -= n
    return digest.hexdigest()


class ChunkedSha256:
    """The sha256 of each `chunk_bytes` of a stream fed in any pieces (`update`), the last chunk shorter."""

    def __init__(self, chunk_bytes: int = CHUNK_HASH_BYTES):
        self.chunk_bytes = chunk_bytes
        self._done: list[str] = []
        self._digest, self._filled = hashlib.sha256(), 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while len(view):
            take = min(len(view), self.chunk_bytes - self._filled)
            self._digest.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self._done.append(self._digest.hexdigest())
                self._digest, self._filled = hashlib.sha256(), 0

    def hexdigests(self) -> list[str]:
        """Every chunk's digest so far, the partial last one included (one for an empty stream)."""
        partial = [self._digest.hexdigest()] if self._filled or not self._done else []
        return self._done + partial


def chunk_hashes(path: Path, chunk_bytes: int = CHUNK_HASH_BYTES) -> list[str]:
    """The sha256 of each `chunk_bytes` of the file at `path`, in one pass over its pages mapped (no copy into a
    buffer: a third faster on a tmpfs file, where the pages are already memory)."""
    hashes = ChunkedSha256(chunk_bytes)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
                view = memoryview(mapped)
                for start in range(0, size, CHUNK):
                    hashes.update(view[start : start + CHUNK])
                del view
    return hashes.hexdigests()


def describe(path: Path) -> tuple[int, list[str]]:
    """(size, chunk sha256s) of a file as it is on disk now."""
    size = path.stat().st_size
    return size, chunk_hashes(path)


def manifest_files(manifest: Any) -> dict[str, Entry]:
    """{file name: Entry} from a manifest. Raises ValueError naming what is wrong when the manifest is not one
    Keel wrote."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError("has no file list")
    hashes = manifest.get("sha256", {})
    chunked = manifest.get("sha256_chunks", {})
    chunk_bytes = manifest.get("chunk_bytes", CHUNK_HASH_BYTES)
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"has chunk_bytes {chunk_bytes!r}")
    files = {}
    for name, size in manifest["files"].items():
        if not isinstance(size, int) or "/" in name or name.startswith("."):
            raise ValueError(f"lists {name!r} with size {size!r}")
        chunks = chunked.get(name)
        if chunks is not None and len(chunks) != max(1, -(-size // chunk_bytes)):
            raise ValueError(f"lists {len(chunks)} chunk hashes for {name!r} of {size} bytes")
        files[name] = Entry(
            size, hashes.get(name), tuple(chunks) if chunks is not None else None, chunk_bytes
        )
    return files


def read_manifest_files(path: Path) -> dict[str, Entry]:
    """`manifest_files` of the manifest at `path`; ValueError (with the reason) for a garbled one."""
    try:
        return manifest_files(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"is not valid JSON ({err})") from err


def pieces(files: Mapping[str, Entry]) -> dict[Piece, int]:
    """Every piece of verification work, with the bytes it reads (what `shares` balances)."""
    out = {}
    for name, entry in sorted(files.items()):
        if entry.chunks is None:
            out[Piece(name, sha256=entry.sha256)] = entry.size
            continue
        for i, digest in enumerate(entry.chunks):
            start = i * entry.chunk_bytes
            length = max(0, min(entry.chunk_bytes, entry.size - start))
            out[Piece(name, start, length, digest)] = length
    return out


def shares(sizes: Mapping[Key, int], world: int) -> list[list[Key]]:
    """The items each of `world` ranks takes: largest first onto the least-loaded rank (within one largest item
    of the best split). Every rank computes the same split from the same manifest; ties break by key."""
    heap = [(0, rank) for rank in range(world)]
    out: list[list[Key]] = [[] for _ in range(world)]
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        load, rank = heapq.heappop(heap)
        out[rank].append(key)
        heapq.heappush(heap, (load + sizes[key], rank))
    return out


def check_piece(path: Path, entry: Entry, piece: Piece) -> str:
    """Why `piece` of `path` does not match its manifest entry ("" when it does)."""
    if not path.is_file():
        return "missing"
    actual = os.stat(path).st_size
    if actual != entry.size:
        return f"{actual} bytes, the manifest says {entry.size}"
    if piece.sha256 is None or sha256_of(path, piece.start, piece.length) == piece.sha256:
        return ""
    if piece.length < 0:
        return "sha256 differs from the manifest's (same size: bytes changed)"
    end = piece.start + piece.length
    return f"sha256 differs from the manifest's in bytes {piece.start}-{end} (same size: bytes changed)"


def check_file(path: Path, size: int, sha256: str | None) -> str:
    """Why `path` does not match a whole-file manifest entry ("" when it does)."""
    return check_piece(path, Entry(size, sha256), Piece(path.name, sha256=sha256))


def verify(
    tag_dir: Path,
    files: Mapping[str, Entry],
    mine: list[Piece],
    threads: int = VERIFY_THREADS,
) -> list[tuple[str, str]]:
    """(file, reason) for each file with a piece of `mine` (this rank's share) that does not match the
    manifest; a file once, with its first bad piece's reason."""

    def one(piece: Piece) -> tuple[str, str]:
        try:
            return piece.name, check_piece(tag_dir / piece.name, files[piece.name], piece)
        except OSError as err:  # unreadable: as bad as missing
            return piece.name, f"unreadable ({err.strerror or err})"

    found: dict[str, str] = {}
    with ThreadPoolExecutor(max(1, min(threads, len(mine)))) as pool:
        for name, reason in pool.map(one, mine):
            if reason:
                found.setdefault(name, reason)
    return sorted(found.items())


def set_aside(directory: Path, tag: str) -> Path:
    """Rename `directory/tag` to `tag.corrupt` (`.corrupt.2`, ... when set aside before); never deleted."""
    target = directory / f"{tag}{CORRUPT_SUFFIX}"
    n = 1
    while target.exists():
        n += 1
        target = directory / f"{tag}{CORRUPT_SUFFIX}.{n}"
    (directory / tag).rename(target)
    return target
