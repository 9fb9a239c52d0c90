"""A memory-mapped token store: `<prefix>.bin` holds every document's ids back to back, `<prefix>.idx` where
each document starts.

Memory mapping lets every rank and dataloader worker share one page-cached copy and start instantly however
large the corpus. Both files are written under temporary names and renamed into place, so a reader never sees
a half-written pair; the index records sizes that are checked on open, so a mismatched or truncated pair is
reported instead of silently read.
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from keel.data.atomic import temp_sibling, write_atomic
from keel.data.errors import DataError

MAGIC = b"KEELIDX\0"
VERSION = 1
# magic, version, dtype code (bytes per token), vocab_size, n_docs; then int64 offsets[n_docs + 1].
_HEADER = struct.Struct("<8sIIQQ")
_DTYPES = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def best_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below `vocab_size`."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise DataError(f"vocab_size={vocab_size} is out of range; it must be between 1 and 2**32")
    for dtype in _DTYPES.values():
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return dtype
    raise AssertionError("unreachable")


def _fix_hint(path: Path) -> str:
    return f"{path}: re-run `keel prepare` to rebuild it"


class IndexedDatasetWriter:
    """Streams documents to disk; only the offsets (8 bytes per document) are kept in memory."""

    def __init__(self, prefix: str | Path, vocab_size: int) -> None:
        self.prefix = Path(prefix)
        self.vocab_size = vocab_size
        self.dtype = best_dtype(vocab_size)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = temp_sibling(Path(f"{self.prefix}.bin"))
        self._bin = open(self._bin_tmp, "xb")
        self._offsets = array("q", [0])
        self._finalized = False

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    @property
    def num_docs(self) -> int:
        return len(self._offsets) - 1

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        if self._finalized:
            raise RuntimeError("add_document() after finalize()")
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise DataError(f"document {self.num_docs}: expected a flat sequence of token ids, got shape {arr.shape}")
        if arr.size:
            if not np.issubdtype(arr.dtype, np.integer):
                raise DataError(f"document {self.num_docs}: token ids must be integers, got {arr.dtype}")
            low, high = int(arr.min()), int(arr.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise DataError(
                    f"document {self.num_docs}: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
                )
            self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._offsets.append(self._offsets[-1] + int(arr.size))

    def finalize(self) -> None:
        """Write the index and move both files into place (the .bin first; the .idx last marks completion)."""
        if self._finalized:
            return
        header = _HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.vocab_size, self.num_docs)
        offsets = np.frombuffer(self._offsets, dtype=np.int64).astype("<i8").tobytes()
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            os.replace(self._bin_tmp, f"{self.prefix}.bin")
            write_atomic(Path(f"{self.prefix}.idx"), header + offsets)
        except BaseException:
            self.abort()
            raise
        self._finalized = True

    def abort(self) -> None:
        """Drop everything written so far; the target files are left untouched."""
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)
        self._finalized = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of a prepared token store; `ds[i]` is document i's ids (a view into the memory map)."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix)
        idx_path, bin_path = Path(f"{self.prefix}.idx"), Path(f"{self.prefix}.bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise DataError(f"{path} is missing; re-run `keel prepare`")
        idx_size = idx_path.stat().st_size
        with open(idx_path, "rb") as handle:
            header = handle.read(_HEADER.size)
        if len(header) < _HEADER.size:
            raise DataError(f"{_fix_hint(idx_path)} (truncated header)")
        magic, version, code, vocab_size, n_docs = _HEADER.unpack(header)
        if magic != MAGIC:
            raise DataError(f"{_fix_hint(idx_path)} (not a Keel index file)")
        if version != VERSION:
            raise DataError(f"{_fix_hint(idx_path)} (format version {version}, this Keel reads {VERSION})")
        if code not in _DTYPES:
            raise DataError(f"{_fix_hint(idx_path)} (unknown token dtype code {code})")
        if idx_size != _HEADER.size + 8 * (n_docs + 1):
            raise DataError(f"{_fix_hint(idx_path)} (size {idx_size} does not match {n_docs} documents)")
        self.vocab_size = int(vocab_size)
        self.dtype = _DTYPES[code]
        self.doc_offsets = np.memmap(idx_path, dtype="<i8", mode="r", offset=_HEADER.size, shape=(n_docs + 1,))
        num_tokens = int(self.doc_offsets[-1])
        bin_size = bin_path.stat().st_size
        if bin_size != num_tokens * self.dtype.itemsize:
            raise DataError(f"{_fix_hint(bin_path)} (holds {bin_size} bytes, index expects {num_tokens} tokens)")
        if self.doc_offsets[0] != 0 or (n_docs and bool(np.any(np.diff(self.doc_offsets) < 0))):
            raise DataError(f"{_fix_hint(idx_path)} (document offsets are not increasing)")
        if num_tokens:
            self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(num_tokens,))
        else:  # mmap refuses empty files
            self.tokens = np.zeros(0, dtype=self.dtype)

    def __reduce__(self) -> tuple[type, tuple[Path]]:
        # Re-open the maps in the receiving process rather than pickling the whole token array.
        return (IndexedDataset, (self.prefix,))

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return int(self.doc_offsets.shape[0]) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents")
        return self.tokens[self.doc_offsets[i] : self.doc_offsets[i + 1]]
