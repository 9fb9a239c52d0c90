"""Megatron-Core's `.idx` layout and Keel's `.json` sidecar, byte for byte.

The layout is the one `megatron/core/datasets/indexed_dataset.py` (`_IndexWriter`/`_IndexReader`) writes and
reads: `b"MMIDIDX\\x00\\x00"`, `<Q` version 1, `<B` dtype code, `<Q` sequence count, `<Q` document count, then
int32 sequence lengths, int64 sequence byte pointers and int64 document indices (sequence numbers where each
document starts, plus the total). Megatron-Core's builder holds every length in a Python list and its reader
needs torch, so neither is used here: Keel streams the lengths through a temporary file and writes the index in
fixed-size chunks, so writing costs the same memory for ten documents or ten billion.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from keel.data.errors import DataError
from keel.run_dir import write_atomic

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# magic, version, dtype code, sequence count, document count: 34 bytes
HEADER = struct.Struct("<9sQBQQ")
# Megatron-Core's DType enum.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}
MAX_SEQUENCE_LENGTH = 2**31 - 1  # lengths are int32 in the index
SIDECAR_FORMAT = "keel-token-file"
SIDECAR_VERSION = 1
CHUNK = 1 << 20  # index entries per streamed chunk (8 MiB of int64)


def fix_hint(path: Path) -> str:
    return f"{path}: re-run `keel prepare` to rebuild it"


@dataclass(frozen=True)
class IndexHeader:
    dtype: np.dtype
    sequence_count: int
    document_count: int  # entries of document_indices: documents + 1

    @property
    def lengths_offset(self) -> int:
        return HEADER.size

    @property
    def pointers_offset(self) -> int:
        return HEADER.size + 4 * self.sequence_count

    @property
    def documents_offset(self) -> int:
        return self.pointers_offset + 8 * self.sequence_count

    @property
    def index_size(self) -> int:
        return self.documents_offset + 8 * self.document_count


def read_header(idx_path: Path) -> IndexHeader:
    """Parse and size-check an `.idx` header; every failure is one DataError line naming the file."""
    idx_size = idx_path.stat().st_size
    with open(idx_path, "rb") as handle:
        raw = handle.read(HEADER.size)
    if len(raw) < HEADER.size:
        if not raw.startswith(MAGIC[: len(raw)]) or len(raw) < len(MAGIC):
            raise DataError(
                f"{idx_path}: not a Megatron indexed-dataset index (no MMIDIDX header); "
                "point data.corpus at a .bin/.idx pair or re-run `keel prepare`"
            )
        raise DataError(
            f"{fix_hint(idx_path)} (truncated header: {len(raw)} of {HEADER.size} bytes)"
        )
    magic, version, code, sequences, documents = HEADER.unpack(raw)
    if magic != MAGIC:
        raise DataError(
            f"{idx_path}: not a Megatron indexed-dataset index (no MMIDIDX header at byte 0); "
            "point data.corpus at a .bin/.idx pair or re-run `keel prepare`"
        )
    if version != VERSION:
        raise DataError(
            f"{fix_hint(idx_path)} (index version {version} at byte 9; Megatron and Keel write {VERSION})"
        )
    if code not in DTYPE_CODES:
        raise DataError(f"{fix_hint(idx_path)} (unknown token dtype code {code} at byte 17)")
    if DTYPE_CODES[code].kind == "f":
        raise DataError(
            f"{idx_path}: holds {DTYPE_CODES[code]} values, not token ids (dtype code {code} at byte 17); "
            "use a token file written by a tokenizer (integer dtype)"
        )
    header = IndexHeader(DTYPE_CODES[code], sequences, documents)
    if idx_size == header.index_size + sequences and sequences:
        raise DataError(
            f"{idx_path}: a multimodal token file (with sequence modes); Keel reads text-only files"
        )
    if idx_size != header.index_size or documents < 1:
        raise DataError(
            f"{fix_hint(idx_path)} (size {idx_size} does not match the {sequences} sequences and "
            f"{documents} document entries its header records at bytes 18..33)"
        )
    return header


def write_index(out: BinaryIO, dtype: np.dtype, lengths: BinaryIO, sequence_count: int) -> None:
    """Write a whole `.idx` for one-sequence-per-document data, reading the int32 lengths from `lengths`."""
    out.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[dtype], sequence_count, sequence_count + 1))
    lengths.seek(0)
    for chunk in _chunks(lengths, sequence_count):
        out.write(chunk.tobytes())
    pointer = 0
    lengths.seek(0)
    # byte pointers: the exclusive running sum of length*itemsize
    for chunk in _chunks(lengths, sequence_count):
        ends = np.cumsum(chunk, dtype=np.int64) * dtype.itemsize + pointer
        starts = np.empty_like(ends)
        starts[0], starts[1:] = pointer, ends[:-1]
        out.write(starts.astype("<i8").tobytes())
        pointer = int(ends[-1])
    for first in range(0, sequence_count + 1, CHUNK):  # document i starts at sequence i
        out.write(np.arange(first, min(first + CHUNK, sequence_count + 1), dtype="<i8").tobytes())


def _chunks(lengths: BinaryIO, count: int):
    left = count
    while left:
        take = min(left, CHUNK)
        raw = lengths.read(4 * take)
        if len(raw) != 4 * take:
            raise RuntimeError("the temporary lengths file is shorter than the documents written")
        yield np.frombuffer(raw, dtype="<i4")
        left -= take


def sidecar_path(prefix: Path) -> Path:
    return Path(f"{prefix}.json")


def write_sidecar(prefix: Path, record: dict[str, Any]) -> None:
    """PREFIX.json: what the pair itself cannot say (its vocabulary and tokenizer), written atomically."""
    body = {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, **record}
    write_atomic(sidecar_path(prefix), (json.dumps(body, indent=2, sort_keys=True) + "\n").encode())


def read_sidecar(prefix: Path) -> dict[str, Any] | None:
    """The sidecar's record, None when there is none (a file from Megatron-LM or GPT-NeoX)."""
    path = sidecar_path(prefix)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path}: not valid JSON ({exc.msg}); delete it or re-run `keel prepare`"
        ) from None
    if not isinstance(record, dict) or record.get("format") != SIDECAR_FORMAT:
        raise DataError(
            f"{path}: not a Keel token-file sidecar; move it away from the .bin/.idx pair"
        )
    if record.get("version") != SIDECAR_VERSION:
        raise DataError(
            f"{fix_hint(path)} (sidecar version {record.get('version')}, this Keel reads "
            f"{SIDECAR_VERSION})"
        )
    vocab = record.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise DataError(f"{fix_hint(path)} (vocab_size {vocab!r} is not a positive integer)")
    return record


def fsync_close(handle: BinaryIO) -> None:
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()
