"""Checkpoint contents against the manifest: every file's size and sha256, read once across the world.

A checkpoint whose completion marker exists can still be bad: a shard cut short by a full disk or a dying node,
flipped bytes on a failing drive, a rank file deleted by hand. DeepSpeed would load most of these silently and
the run would go non-finite a few steps later, blaming its data. So `keel_complete.json` records each file's
size and sha256 (hashed by the rank that wrote it, keel/training/checkpoint/writes.py), and a load verifies them:
each rank hashes a byte-balanced share of the files (`shares`), on a few threads, so the checkpoint is read once
in total whatever the world size — at 512 ranks each reads about 1/512 of it — and the verdicts meet in one
all-gather (keel/training/checkpoint/store.py `Checkpointer.agree_on`). A manifest written before hashes were
recorded has sizes only; its files are checked by size.

A bad checkpoint is never deleted: `set_aside` renames it `stepN.corrupt` (kept for a post-mortem, no longer a
checkpoint: discovery and pruning only see `stepNNNNNNNN` names).
"""

from __future__ import annotations

import hashlib
import heapq
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# bytes read per update: hashlib releases the GIL on buffers this size, so threads overlap
CHUNK = 8 << 20
VERIFY_THREADS = 4
CORRUPT_SUFFIX = ".corrupt"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def describe(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file as it is on disk now."""
    size = path.stat().st_size
    return size, sha256_of(path)


def manifest_files(manifest: Any) -> dict[str, tuple[int, str | None]]:
    """{file name: (size, sha256 or None)} from a manifest (None: written before hashes were recorded).
    Raises ValueError naming what is wrong when the manifest is not one Keel wrote."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError("has no file list")
    hashes = manifest.get("sha256", {})
    files = {}
    for name, size in manifest["files"].items():
        if not isinstance(size, int) or "/" in name or name.startswith("."):
            raise ValueError(f"lists {name!r} with size {size!r}")
        files[name] = (size, hashes.get(name))
    return files


def read_manifest_files(path: Path) -> dict[str, tuple[int, str | None]]:
    """`manifest_files` of the manifest at `path`; ValueError (with the reason) for a garbled one."""
    try:
        return manifest_files(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"is not valid JSON ({err})") from err


def shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """The files each of `world` ranks verifies: largest first onto the least-loaded rank (within one largest
    file of the best split). Every rank computes the same split from the same manifest; ties break by name."""
    heap = [(0, rank) for rank in range(world)]
    out: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(heap)
        out[rank].append(name)
        heapq.heappush(heap, (load + sizes[name], rank))
    return out


def check_file(path: Path, size: int, sha256: str | None) -> str:
    """Why `path` does not match its manifest entry ("" when it does)."""
    if not path.is_file():
        return "missing"
    actual = path.stat().st_size
    if actual != size:
        return f"{actual} bytes, the manifest says {size}"
    if sha256 is not None and sha256_of(path) != sha256:
        return "sha256 differs from the manifest's (same size: bytes changed)"
    return ""


def verify(
    tag_dir: Path,
    files: dict[str, tuple[int, str | None]],
    names: list[str],
    threads: int = VERIFY_THREADS,
) -> list[tuple[str, str]]:
    """(file, reason) for each of `names` (this rank's share) that does not match the manifest."""

    def one(name: str) -> tuple[str, str]:
        try:
            return name, check_file(tag_dir / name, *files[name])
        except OSError as err:  # unreadable: as bad as missing
            return name, f"unreadable ({err.strerror or err})"

    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        return [(name, reason) for name, reason in pool.map(one, names) if reason]


def set_aside(directory: Path, tag: str) -> Path:
    """Rename `directory/tag` to `tag.corrupt` (`.corrupt.2`, ... when set aside before); never deleted."""
    target = directory / f"{tag}{CORRUPT_SUFFIX}"
    n = 1
    while target.exists():
        n += 1
        target = directory / f"{tag}{CORRUPT_SUFFIX}.{n}"
    (directory / tag).rename(target)
    return target
