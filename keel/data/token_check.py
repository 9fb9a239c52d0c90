"""Is a token file sound? The checks that name what is wrong, where, in one line.

A token file given by the user (Megatron-LM, GPT-NeoX, or copied around) may be corrupt: an `.idx` whose lengths,
pointers and document index disagree with each other or with the `.bin`, or ids its tokenizer never made. Two
checks cover it without reading every id before training:

- **Before launch** (`check_token_file`): the whole `.idx` streamed in fixed-size chunks (vectorised: lengths,
  pointers as the running sum of lengths × itemsize, the `.bin` length, the document index), plus a bounded id
  sample (SAMPLE_CHUNKS evenly spaced spans, SAMPLE_BYTES in all) against the vocabulary. Cost grows with the
  number of sequences (about 0.3 s for 20M: bench/token_check.py) and not with the number of tokens.
- **At the sample** (`first_bad_row`): every step's batch, one vectorised min/max on the host, run by the prefetch
  worker thread while the previous step computes (about 0.1 ms; keel/training/data_stop.py turns a hit into an
  agreed stop), so an id the sample missed stops the run with the
  same kind of line instead of an `IndexError` deep in the embedding. `check_windows` reads the evaluation's few
  fixed windows in full before launch.

Every problem is a DataError of one line naming the file, the sequence or document, and the byte or token offset.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from keel.data import megatron_index as layout
from keel.data.bad_ids import bad_id_line
from keel.data.errors import DataError
from keel.data.indexed import IndexedDataset, token_file_prefix

SAMPLE_CHUNKS = 64  # evenly spaced spans of the id sample
SAMPLE_BYTES = 4 << 20  # the id sample's total size: constant, however large the file
_REGENERATE = "the index is corrupt: regenerate the token file with the tool that wrote it (Keel: `keel prepare`)"


def check_token_file(prefix: str | Path, vocab_size: int) -> IndexedDataset:
    """The pre-launch check: the whole index streamed, then the id sample; returns the opened dataset."""
    prefix = token_file_prefix(prefix)
    check_index(prefix)
    dataset = IndexedDataset(prefix, vocab_size=vocab_size)
    check_id_sample(dataset, vocab_size)
    return dataset


def check_index(prefix: Path) -> layout.IndexHeader:
    """Stream the `.idx` (CHUNK entries at a time) against itself and the `.bin` length; the first problem found
    raises one DataError line naming the file, the sequence or document, and its byte offset."""
    idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    header = layout.read_header(idx_path)
    n, itemsize = header.sequence_count, header.dtype.itemsize
    lengths = (
        np.memmap(idx_path, dtype="<i4", mode="r", offset=header.lengths_offset, shape=(n,))
        if n
        else np.zeros(0, dtype="<i4")
    )
    pointers = (
        np.memmap(idx_path, dtype="<i8", mode="r", offset=header.pointers_offset, shape=(n,))
        if n
        else np.zeros(0, dtype="<i8")
    )
    pointer = 0  # where the next sequence must start: the running sum of lengths x itemsize
    for first in range(0, n, layout.CHUNK):
        chunk = np.asarray(lengths[first : first + layout.CHUNK], dtype=np.int64)
        if int(chunk.min()) < 0:
            i = first + int(np.argmax(chunk < 0))
            raise DataError(
                f"{idx_path}: sequence {i} has length {int(lengths[i])} (byte "
                f"{header.lengths_offset + 4 * i}), a negative length; {_REGENERATE}"
            )
        ends = np.cumsum(chunk) * itemsize + pointer
        starts = np.empty_like(ends)
        starts[0], starts[1:] = pointer, ends[:-1]
        wrong = starts != pointers[first : first + len(chunk)]
        if wrong.any():
            i = int(np.argmax(wrong))
            raise DataError(
                f"{idx_path}: sequence {first + i} starts at .bin byte {int(pointers[first + i])} (index "
                f"byte {header.pointers_offset + 8 * (first + i)}), but the lengths before it put it at "
                f"byte {int(starts[i])}; {_REGENERATE}"
            )
        pointer = int(ends[-1])
    bin_size = bin_path.stat().st_size
    if bin_size != pointer:
        what = "truncated" if bin_size < pointer else "longer than its index says"
        raise DataError(
            f"{layout.fix_hint(bin_path)} (holds {bin_size} bytes, its index expects {pointer} for its {n} "
            f"sequences: the .bin is {what} from token {min(bin_size, pointer) // itemsize}, byte "
            f"{min(bin_size, pointer)}; a token file not made by Keel: regenerate or copy it again)"
        )
    _check_documents(idx_path, header)
    return header


def _check_documents(idx_path: Path, header: layout.IndexHeader) -> None:
    """Document i starts at sequence documents[i]: from 0, never decreasing, ending at the sequence count."""
    n, count = header.sequence_count, header.document_count
    documents = np.memmap(
        idx_path, dtype="<i8", mode="r", offset=header.documents_offset, shape=(count,)
    )
    previous = 0
    for first in range(0, count, layout.CHUNK):
        chunk = np.asarray(documents[first : first + layout.CHUNK])
        steps = np.diff(chunk, prepend=previous)
        bad = (chunk < 0) | (chunk > n) | (steps < 0)
        if first == 0 and chunk[0] != 0:
            bad[0] = True
        if bad.any():
            i = int(np.argmax(bad))
            at, value = first + i, int(chunk[i])
            why = (
                "the first must be 0"
                if at == 0 and value != 0
                else f"beyond the {n} sequences"
                if not 0 <= value <= n
                else f"before document {at - 1}'s start at sequence {int(value - steps[i])}"
            )
            raise DataError(
                f"{idx_path}: document {at} starts at sequence {value} (byte "
                f"{header.documents_offset + 8 * at}), {why}; {_REGENERATE}"
            )
        previous = int(chunk[-1])
    if previous != n:
        raise DataError(
            f"{idx_path}: the document index ends at sequence {previous} (byte "
            f"{header.documents_offset + 8 * (count - 1)}), not at the {n} sequences it holds; "
            f"{_REGENERATE}"
        )


def sample_spans(
    num_tokens: int, itemsize: int, chunks: int = SAMPLE_CHUNKS, total_bytes: int = SAMPLE_BYTES
) -> list[tuple[int, int]]:
    """The token ranges [start, end) the id sample reads: `chunks` evenly spaced spans of `total_bytes` in all
    (the whole file when it is smaller)."""
    span = max(1, total_bytes // chunks // itemsize)
    if num_tokens <= span * chunks:
        return [(start, min(start + span, num_tokens)) for start in range(0, num_tokens, span)]
    starts = np.linspace(0, num_tokens - span, chunks).astype(np.int64)
    return [(int(s), int(s) + span) for s in starts]


def check_id_sample(dataset: IndexedDataset, vocab_size: int) -> None:
    """Every id in the sampled spans lies in [0, vocab_size); the first that does not raises its line."""
    for start, end in sample_spans(
        dataset.num_tokens, dataset.dtype.itemsize, SAMPLE_CHUNKS, SAMPLE_BYTES
    ):
        span = np.asarray(dataset.tokens[start:end])
        if int(span.min()) < 0 or int(span.max()) >= vocab_size:
            token = start + int(np.argmax((span < 0) | (span >= vocab_size)))
            raise DataError(
                bad_id_line(
                    dataset,
                    token,
                    vocab_size,
                    "use the tokenizer that made this file (data.tokenizer)",
                )
            )


def check_windows(samples, sample_ids: range, vocab_size: int, label: str) -> None:
    """Every id of the given windows of `samples` (PackedSamples or a blend's) lies in [0, vocab_size): the
    evaluation's fixed windows, checked in full before launch."""
    for i in sample_ids:
        window = samples.window(i)
        bad = np.flatnonzero((window < 0) | (window >= vocab_size))
        if bad.size:
            dataset, begin = samples.origin(i)
            raise DataError(
                bad_id_line(
                    dataset,
                    begin + int(bad[0]),
                    vocab_size,
                    "every evaluation reads it; "
                    "fix or regenerate the file (or set train.eval_interval=0)",
                    f", {label} sample {i}",
                )
            )


def first_bad_row(micro_batches: list[torch.Tensor], vocab_size: int) -> int | None:
    """The at-sample check: the first row (counting across the step's micro-batches in order) holding an id
    outside [0, vocab_size), or None. One vectorised min and max over the batch when it is clean."""
    offset = 0
    for batch in micro_batches:
        low, high = torch.aminmax(batch)
        if int(low) < 0 or int(high) >= vocab_size:
            return offset + int(torch.nonzero(((batch < 0) | (batch >= vocab_size)).any(dim=1))[0])
        offset += batch.shape[0]
    return None


def stand_in(micro_batches: list[torch.Tensor], vocab_size: int) -> list[torch.Tensor]:
    """The batch with every out-of-vocabulary id replaced by id 0, so a step that will be stopped still runs."""
    return [torch.where((b < 0) | (b >= vocab_size), torch.zeros_like(b), b) for b in micro_batches]
