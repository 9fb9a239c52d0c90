"""Token files in Megatron-Core's indexed-dataset layout: `PREFIX.bin` holds every document's ids back to back,
`PREFIX.idx` (keel/data/megatron_index.py) where each starts, `PREFIX.json` the vocabulary and tokenizer.

One layout for Keel's own output and for corpora tokenized by Megatron-LM or GPT-NeoX, so either tool reads the
other's files in place. Memory mapping lets every rank and dataloader worker share one page-cached copy and start
instantly however large the corpus. Opening checks only sizes and end points (constant work, so 512 ranks can
open a 300B-token file at once). Before launch keel/data/token_check.py streams the whole index and reads a
bounded id sample; ids are checked in full where they are used, each step's batch (keel/training/data_stop.py).
`validate()` is the offline pass over every id (`keel prepare --check-all-ids`): its cost grows with the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from keel.data import megatron_index as layout
from keel.data.bad_ids import bad_id_line
from keel.data.errors import DataError
from keel.run_dir import temp_sibling

_WRITE_BUFFER = 1 << 20
_SCAN_TOKENS = 1 << 24  # ids per chunk of the vocabulary scan


def best_dtype(vocab_size: int) -> np.dtype:
    """The smallest Megatron token dtype that holds every id below `vocab_size` (Megatron has no uint32)."""
    if vocab_size < 1 or vocab_size > 2**31:
        raise DataError(f"vocab_size={vocab_size} is out of range; it must be between 1 and 2**31")
    for dtype in (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32)):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return dtype
    raise AssertionError("unreachable")


def token_file_prefix(path: str | Path) -> Path:
    """`x`, `x.bin` and `x.idx` all name the pair with prefix `x`."""
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".bin", ".idx") else path


def is_token_file(path: str | Path) -> bool:
    """Whether `path` (with or without `.bin`/`.idx`) names an existing `.bin` + `.idx` pair."""
    prefix = token_file_prefix(path)
    return Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()


class IndexedDatasetWriter:
    """Streams documents to `PREFIX.bin`; the lengths go to a temporary file, so memory stays constant.

    Every document is one Megatron sequence and one document. Nothing is visible under the target names until
    `finalize()` renames the finished files into place: the `.bin`, then the sidecar, the `.idx` last.
    """

    def __init__(
        self,
        prefix: str | Path,
        vocab_size: int,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        tokenizer: str | None = None,
        tokenizer_hash: str | None = None,
    ) -> None:
        self.prefix = Path(prefix)
        self.vocab_size = vocab_size
        self.dtype = best_dtype(vocab_size)
        self._meta = {
            "bos_id": bos_id,
            "eos_id": eos_id,
            "pad_id": pad_id,
            "tokenizer": tokenizer,
            "tokenizer_hash": tokenizer_hash,
        }
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = temp_sibling(Path(f"{self.prefix}.bin"))
        self._lengths_tmp = temp_sibling(Path(f"{self.prefix}.lengths"))
        self._bin = open(self._bin_tmp, "xb", buffering=_WRITE_BUFFER)
        self._lengths = open(self._lengths_tmp, "xb+", buffering=_WRITE_BUFFER)
        self.num_tokens = 0
        self.num_docs = 0
        self._finalized = False

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise DataError(
                f"document {self.num_docs}: expected a flat sequence of token ids, got shape {arr.shape}"
            )
        self.add_documents(arr, np.array([arr.size], dtype=np.int64))

    def add_documents(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append several documents at once: `ids` back to back, `lengths[i]` ids for document i."""
        if self._finalized:
            raise RuntimeError("add_documents() after finalize()")
        lengths = np.asarray(lengths, dtype=np.int64)
        if ids.size:
            if not np.issubdtype(ids.dtype, np.integer):
                raise DataError(
                    f"document {self.num_docs}: token ids must be integers, got {ids.dtype}"
                )
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                where = self.num_docs + int(
                    np.searchsorted(np.cumsum(lengths), np.flatnonzero(ids == bad)[0], side="right")
                )
                raise DataError(
                    f"document {where}: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
                )
        if int(lengths.sum()) != ids.size or (
            lengths.size and int(lengths.max()) > layout.MAX_SEQUENCE_LENGTH
        ):
            raise DataError(
                f"document {self.num_docs}: lengths do not add up to the ids given, or a document "
                f"exceeds {layout.MAX_SEQUENCE_LENGTH} tokens (the index stores int32 lengths)"
            )
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes())
        self._lengths.write(lengths.astype("<i4").tobytes())
        self.num_tokens += int(ids.size)
        self.num_docs += int(lengths.size)

    def finalize(self) -> None:
        """Write the index and the sidecar, and move all three into place."""
        if self._finalized:
            return
        try:
            layout.fsync_close(self._bin)
            self._lengths.flush()
            idx_tmp = temp_sibling(Path(f"{self.prefix}.idx"))
            try:
                with open(idx_tmp, "xb", buffering=_WRITE_BUFFER) as out:
                    layout.write_index(out, self.dtype, self._lengths, self.num_docs)
                    layout.fsync_close(out)
                self._lengths.close()
                self._lengths_tmp.unlink()
                Path(self._bin_tmp).replace(f"{self.prefix}.bin")
                layout.write_sidecar(
                    self.prefix,
                    {
                        "vocab_size": self.vocab_size,
                        "num_tokens": self.num_tokens,
                        "num_docs": self.num_docs,
                        "dtype": self.dtype.name,
                        **self._meta,
                    },
                )
                idx_tmp.replace(f"{self.prefix}.idx")
            finally:
                idx_tmp.unlink(missing_ok=True)
        except BaseException:
            self.abort()
            raise
        self._finalized = True

    def abort(self) -> None:
        """Drop everything written so far; the target files are left untouched."""
        for handle in (self._bin, self._lengths):
            handle.close()
        self._bin_tmp.unlink(missing_ok=True)
        self._lengths_tmp.unlink(missing_ok=True)
        self._finalized = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of a token file; `ds[i]` is document i's ids (a view into the memory map).

    The vocabulary comes from the sidecar `PREFIX.json` when there is one, else from `vocab_size` (the
    tokenizer's: files written by Megatron-LM or GPT-NeoX have no sidecar).
    """

    def __init__(self, prefix: str | Path, vocab_size: int | None = None) -> None:
        self.prefix = token_file_prefix(prefix)
        idx_path, bin_path = Path(f"{self.prefix}.idx"), Path(f"{self.prefix}.bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise DataError(
                    f"{path} is missing; re-run `keel prepare` or point data.corpus at a .bin/.idx pair"
                )
        header = layout.read_header(idx_path)
        self.dtype = header.dtype
        self.metadata: dict[str, Any] | None = layout.read_sidecar(self.prefix)
        self._caller_vocab = vocab_size
        if self.metadata is not None:
            vocab_size = self.metadata["vocab_size"]
        if vocab_size is None:
            raise DataError(
                f"{idx_path}: no sidecar {self.prefix}.json records its vocabulary; open it with the "
                "tokenizer that made it (IndexedDataset(prefix, vocab_size=...), data.tokenizer)"
            )
        self.vocab_size = int(vocab_size)
        n, d = header.sequence_count, header.document_count
        self.sequence_lengths = np.memmap(
            idx_path, dtype="<i4", mode="r", offset=header.lengths_offset, shape=(n,)
        )
        self.sequence_pointers = np.memmap(
            idx_path, dtype="<i8", mode="r", offset=header.pointers_offset, shape=(n,)
        )
        self.document_indices = np.memmap(
            idx_path, dtype="<i8", mode="r", offset=header.documents_offset, shape=(d,)
        )
        if int(self.document_indices[0]) != 0 or int(self.document_indices[-1]) != n:
            raise DataError(
                f"{layout.fix_hint(idx_path)} (document indices run {int(self.document_indices[0])}.."
                f"{int(self.document_indices[-1])}, expected 0..{n})"
            )
        itemsize = self.dtype.itemsize
        expected = (
            int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize if n else 0
        )
        bin_size = bin_path.stat().st_size
        if bin_size != expected or (n and int(self.sequence_pointers[0]) != 0):
            raise DataError(
                f"{layout.fix_hint(bin_path)} (holds {bin_size} bytes, its index expects {expected})"
            )
        num_tokens = bin_size // itemsize
        if self.metadata is not None and (
            self.metadata.get("num_tokens"),
            self.metadata.get("num_docs"),
        ) != (num_tokens, d - 1):
            raise DataError(
                f"{layout.fix_hint(layout.sidecar_path(self.prefix))} (it records "
                f"{self.metadata.get('num_tokens')} tokens in {self.metadata.get('num_docs')} documents, "
                f"the pair holds {num_tokens} in {d - 1})"
            )
        if num_tokens:
            self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(num_tokens,))
        else:  # mmap refuses empty files
            self.tokens = np.zeros(0, dtype=self.dtype)

    def __reduce__(self) -> tuple[type, tuple[Path, int | None]]:
        # Re-open the maps in the receiving process rather than pickling the whole token array.
        return (IndexedDataset, (self.prefix, self._caller_vocab))

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    def _token_offset(self, sequence: int) -> int:
        """Token index where `sequence` starts (the end of the file for the one past the last)."""
        if sequence >= self.sequence_lengths.shape[0]:
            return self.num_tokens
        return int(self.sequence_pointers[sequence]) // self.dtype.itemsize

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents")
        begin = self._token_offset(int(self.document_indices[i]))
        return self.tokens[begin : self._token_offset(int(self.document_indices[i + 1]))]

    @cached_property
    def doc_offsets(self) -> np.ndarray:
        """Token offset of every document plus the total (int64, 8 bytes per document in memory)."""
        starts = self.document_indices[:-1]
        offsets = np.empty(len(self) + 1, dtype=np.int64)
        offsets[-1] = self.num_tokens
        for first in range(0, len(self), layout.CHUNK):
            seqs = np.asarray(starts[first : first + layout.CHUNK])
            inside = seqs < self.sequence_lengths.shape[0]
            chunk = np.full(seqs.shape, self.num_tokens, dtype=np.int64)
            chunk[inside] = self.sequence_pointers[seqs[inside]] // self.dtype.itemsize
            offsets[first : first + len(seqs)] = chunk
        return offsets

    def document_start_at(self, token: int) -> int:
        """Where the document holding token index `token` starts: two binary searches in the maps, no copy."""
        if not 0 <= token < self.num_tokens:
            raise IndexError(f"token {token} out of range for {self.num_tokens} tokens")
        pointer = np.int64(token * self.dtype.itemsize)
        sequence = int(np.searchsorted(self.sequence_pointers, pointer, side="right")) - 1
        document = int(np.searchsorted(self.document_indices, np.int64(sequence), side="right")) - 1
        return self._token_offset(int(self.document_indices[document]))

    def validate(self, vocab_size: int | None = None) -> None:
        """The full check, streamed in chunks: pointers follow the lengths, documents are ordered, and every id
        lies in [0, vocab_size) (default: this file's vocabulary). Raises one DataError line naming the file."""
        vocab = self.vocab_size if vocab_size is None else vocab_size
        idx_path = Path(f"{self.prefix}.idx")
        pointer = 0
        itemsize = self.dtype.itemsize
        for first in range(0, self.sequence_lengths.shape[0], layout.CHUNK):
            lengths = np.asarray(
                self.sequence_lengths[first : first + layout.CHUNK], dtype=np.int64
            )
            ends = np.cumsum(lengths) * itemsize + pointer
            starts = np.concatenate([[pointer], ends[:-1]])
            if lengths.min() < 0 or not np.array_equal(
                starts, self.sequence_pointers[first : first + len(lengths)]
            ):
                raise DataError(
                    f"{layout.fix_hint(idx_path)} (sequence pointers do not follow the sequence lengths "
                    f"near sequence {first}: a .bin with gaps or a corrupt index)"
                )
            pointer = int(ends[-1])
        for first in range(0, len(self), layout.CHUNK):
            docs = np.asarray(self.document_indices[first : first + layout.CHUNK + 1])
            if bool(np.any(np.diff(docs) < 0)):
                raise DataError(
                    f"{layout.fix_hint(idx_path)} (document indices decrease near document {first})"
                )
        for first in range(0, self.num_tokens, _SCAN_TOKENS):
            chunk = self.tokens[first : first + _SCAN_TOKENS]
            low, high = int(chunk.min()), int(chunk.max())
            if low < 0 or high >= vocab:
                at = first + int(np.flatnonzero((chunk < 0) | (chunk >= vocab))[0])
                raise DataError(
                    bad_id_line(
                        self, at, vocab, "use the tokenizer that made this file (data.tokenizer)"
                    )
                )


def write_documents(
    prefix: str | Path, documents: Sequence[Sequence[int]], vocab_size: int, **metadata: Any
) -> IndexedDataset:
    """Write `documents` as a token file and open it (small files: tests, fixtures, tools)."""
    with IndexedDatasetWriter(prefix, vocab_size, **metadata) as writer:
        for doc in documents:
            writer.add_document(np.asarray(doc, dtype=np.int64))
    return IndexedDataset(prefix)
