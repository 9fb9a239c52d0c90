"""Fixed-length training samples and the global order they are consumed in.

The data order is a pure function of (seed, global sample index): epoch e visits the samples in the permutation
`default_rng([seed, e])`, and optimizer step k consumes global indices [k*B, (k+1)*B). Data-parallel ranks split
each step's block, so the samples a step sees do not depend on the world size, and resuming from a checkpoint
needs only the number of samples consumed so far.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from keel.config.rules import parse_skip_range
from keel.data.errors import DataError
from keel.data.indexed import IndexedDataset

SPLITS = ("train", "val")
# a step can straddle one epoch boundary; older permutations are not needed again
_CACHED_EPOCHS = 2


class PackedSamples:
    """One split of the token stream cut into windows of seq_len+1 tokens (inputs plus next-token labels).

    Documents are packed back to back (each already ends in EOS). The validation split is the tail of the stream,
    starting at a document boundary unless that would more than double it (e.g. a single-file corpus), in which
    case it starts mid-document. Consecutive windows share one token: the last label of one is the next's first
    input, so every token is predicted exactly once.

    Every window is checked against the vocabulary the token file records: an id beyond it would be a silently
    zero embedding row under tensor parallelism (the vocab-parallel embedding masks ids it does not own) or a
    device assert on one GPU.
    """

    def __init__(
        self, dataset: IndexedDataset, seq_len: int, split: str, val_fraction: float
    ) -> None:
        if split not in SPLITS:
            raise DataError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if seq_len < 1:
            raise DataError(f"data.seq_len must be at least 1, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        if split == "val" and val_fraction == 0.0:
            raise DataError(
                "data.val_fraction is 0, so there is no validation split; raise it or set train.eval_interval=0"
            )
        self.dataset = dataset
        self.seq_len = seq_len
        self.split = split
        boundary = val_boundary(dataset, seq_len, val_fraction)
        self.start, self.end = (0, boundary) if split == "train" else (boundary, dataset.num_tokens)
        self._len = (self.end - self.start - 1) // seq_len

    @property
    def num_tokens(self) -> int:
        """Tokens in this split."""
        return self.end - self.start

    def __len__(self) -> int:
        return self._len

    @property
    def vocab_size(self) -> int:
        """The vocabulary the token file records (its sidecar's, else the tokenizer's)."""
        return self.dataset.vocab_size

    def origin(self, i: int) -> tuple[IndexedDataset, int]:
        """(token file, index of its first token) of window `i`."""
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} out of range for {self._len} {self.split} samples")
        return self.dataset, self.start + i * self.seq_len

    def window(self, i: int) -> np.ndarray:
        """Window `i` as stored, unchecked: the trainer checks a whole step's batch at once
        (keel/training/data_stop.py)."""
        _, begin = self.origin(i)
        return np.array(self.dataset.tokens[begin : begin + self.seq_len + 1], dtype=np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        window = self.window(i)
        # negligible
        if window.size and (int(window.min()) < 0 or int(window.max()) >= self.dataset.vocab_size):
            bad = int(window.min()) if int(window.min()) < 0 else int(window.max())
            begin = self.origin(i)[1]
            raise DataError(
                f"{self.dataset.prefix}.bin: {self.split} sample {i} (tokens {begin}..{begin + self.seq_len}) holds "
                f"token id {bad}, outside the vocabulary [0, {self.dataset.vocab_size}) its index "
                "records: the file is corrupt or from another tokenizer; re-run `keel prepare`"
            )
        return window


def val_boundary(dataset: IndexedDataset, seq_len: int, val_fraction: float) -> int:
    """The token index where the validation split starts (== num_tokens when val_fraction is 0)."""
    n = dataset.num_tokens
    window = seq_len + 1
    if val_fraction == 0.0:
        if n < window:
            raise DataError(
                f"data: the corpus has {n:,} tokens; seq_len={seq_len} needs at least {window:,}"
            )
        return n
    want = max(math.ceil(val_fraction * n), window)
    latest = n - want  # the split may start here or earlier
    if latest < window:
        need = max(2 * window, math.ceil(window / (1.0 - val_fraction)) + 1)
        raise DataError(
            f"data: the corpus has {n:,} tokens, too few for seq_len={seq_len} with val_fraction={val_fraction} "
            f"(needs about {need:,}); add text or lower data.seq_len"
        )
    # binary searches in the index maps: no per-document copy
    doc_start = dataset.document_start_at(latest)
    if doc_start >= window and latest - doc_start <= want:
        return doc_start
    return latest


class GlobalSampleOrder:
    """Maps a global sample index (counted from the start of training) to a sample id, epoch by epoch."""

    def __init__(self, num_samples: int, seed: int, stream: int | None = None) -> None:
        if num_samples < 1:
            raise DataError("data: the split has no samples; add text or lower data.seq_len")
        if seed < 0:
            raise DataError(f"train.seed must be non-negative, got {seed}")
        self.num_samples = num_samples
        self.seed = seed
        # a blend's source index: equal-sized sources get different permutations
        self.stream = stream
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            key = [self.seed, epoch] if self.stream is None else [self.seed, self.stream, epoch]
            perm = np.random.default_rng(key).permutation(self.num_samples)
            self._perms[epoch] = perm
            while len(self._perms) > _CACHED_EPOCHS:
                del self._perms[next(iter(self._perms))]
        return perm

    def sample_id(self, global_index: int) -> int:
        if global_index < 0:
            raise IndexError(f"global sample index must be non-negative, got {global_index}")
        epoch, pos = divmod(global_index, self.num_samples)
        return int(self.permutation(epoch)[pos])

    def sample_ids(self, global_indices: list[int] | range) -> list[int]:
        return [self.sample_id(g) for g in global_indices]


def check_batch_geometry(global_batch: int, micro_batch: int, dp_size: int) -> None:
    """Raise DataError unless a global batch splits evenly into micro-batches on every data-parallel rank."""
    if global_batch < 1 or micro_batch < 1 or dp_size < 1:
        raise DataError(
            f"train.global_batch_size ({global_batch}), train.micro_batch_size ({micro_batch}) and the "
            f"data-parallel size ({dp_size}) must all be positive"
        )
    if global_batch % (micro_batch * dp_size):
        raise DataError(
            f"train.global_batch_size ({global_batch}) must be a multiple of train.micro_batch_size x data-parallel "
            f"size ({micro_batch} x {dp_size} = {micro_batch * dp_size})"
        )


def step_sample_indices(
    consumed: int, global_batch: int, micro_batch: int, dp_rank: int = 0, dp_size: int = 1
) -> list[int]:
    """Global sample indices rank `dp_rank` processes in the step after `consumed` samples, in micro-batch order.

    With the defaults (rank 0 of 1) this is the whole step: what stability code records for a bad batch.
    """
    check_batch_geometry(global_batch, micro_batch, dp_size)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    if consumed < 0:
        raise ValueError(f"consumed must be non-negative, got {consumed}")
    per_rank = global_batch // dp_size
    first = consumed + dp_rank * per_rank
    return list(range(first, first + per_rank))


def step_batch(
    order: GlobalSampleOrder,
    samples: PackedSamples,
    consumed: int,
    global_batch: int,
    micro_batch: int,
    dp_rank: int,
    dp_size: int,
    checked: bool = True,
) -> list[torch.Tensor]:
    """This rank's micro-batches (LongTensor [micro_batch, seq_len+1] each) for the step after `consumed` samples.

    `checked=False` reads the windows as stored, for a caller that checks the whole batch at once (the trainer)."""
    if order.num_samples != len(samples):
        raise ValueError(
            f"order covers {order.num_samples} samples but the split has {len(samples)}"
        )
    indices = step_sample_indices(consumed, global_batch, micro_batch, dp_rank, dp_size)
    read = samples.__getitem__ if checked else samples.window
    rows = [read(sid) for sid in order.sample_ids(indices)]
    return [
        torch.from_numpy(np.stack(rows[i : i + micro_batch]))
        for i in range(0, len(rows), micro_batch)
    ]


def skip_to(start: int, skip_ranges: list[tuple[int, int]]) -> int:
    """The first sample to read at `start`: past every data.skip_ranges span (sorted) it falls into."""
    for first, end in skip_ranges:
        if first <= start < end:
            start = end
    return start


def parse_skip_ranges(ranges: list[str]) -> list[tuple[int, int]]:
    """data.skip_ranges ("start:end" global sample indices) as sorted (start, end) spans."""
    return sorted(parse_skip_range(item) for item in ranges)
