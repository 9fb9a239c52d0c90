"""Fixed-length training samples and the global order they are consumed in.

The data order is a pure function of (seed, global sample index): epoch e visits the samples in a pseudo-random
permutation keyed by (seed, e) (`GlobalSampleOrder`), and optimizer step k consumes global indices [k*B, (k+1)*B).
Data-parallel ranks split each step's block, so the samples a step sees do not depend on the world size, and
resuming from a checkpoint needs only the number of samples consumed so far.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from keel.config.rules import parse_skip_range
from keel.data.errors import DataError
from keel.data.indexed import IndexedDataset

SPLITS = ("train", "val")
# which order `GlobalSampleOrder` gives: recorded in data.json, a resume on another order is refused
# (keel/launcher/resume_data.py); runs before it recorded none (numpy's `default_rng([seed, epoch]).permutation`)
SAMPLE_ORDER = "feistel-v1"
_FEISTEL_ROUNDS = 6
_MASK64 = (1 << 64) - 1


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


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijective 64-bit mix (round keys)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """`_mix64` over a uint64 array (numpy's uint64 arithmetic wraps, as the masks above do)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class GlobalSampleOrder:
    """Maps a global sample index (counted from the start of training) to a sample id, epoch by epoch.

    Each epoch's order is a permutation of [0, num_samples) computed per index — a keyed Feistel network on the
    smallest even power of two that holds the samples, walking the cycle back into range — so a rank holds no
    per-sample state: memory does not grow with the corpus (a stored permutation of 10^10 tokens in windows of
    2,048 would be 39 MB per epoch on every rank). The same (seed, stream, epoch) gives the same order anywhere.
    """

    def __init__(self, num_samples: int, seed: int, stream: int | None = None) -> None:
        if num_samples < 1:
            raise DataError("data: the split has no samples; add text or lower data.seq_len")
        if seed < 0:
            raise DataError(f"train.seed must be non-negative, got {seed}")
        self.num_samples = num_samples
        self.seed = seed
        # a blend's source index: equal-sized sources get different permutations
        self.stream = stream
        self._half = (
            max(1, (max(2, num_samples) - 1).bit_length() + 1) // 2
        )  # bits per Feistel half
        self._keys: dict[int, np.ndarray] = {}

    def _round_keys(self, epoch: int) -> np.ndarray:
        keys = self._keys.get(epoch)
        if keys is None:
            base = _mix64(
                _mix64(_mix64(self.seed) ^ (self.stream if self.stream is not None else _MASK64))
                ^ epoch
            )
            keys = np.array([_mix64(base ^ r) for r in range(_FEISTEL_ROUNDS)], dtype=np.uint64)
            self._keys = {
                epoch: keys
            }  # a step straddles at most one boundary: one epoch's keys at a time
        return keys

    def _permute(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s sample ids at `positions` (each in [0, num_samples))."""
        keys, half = self._round_keys(epoch), np.uint64(self._half)
        mask = np.uint64((1 << self._half) - 1)
        out = positions.astype(np.uint64)
        todo = np.ones(out.shape, dtype=bool)
        while todo.any():  # cycle-walking: the domain is under 4x the samples, ~2 passes on average
            x = out[todo]
            left, right = x >> half, x & mask
            for key in keys:
                left, right = right, left ^ (_mix64_array(right ^ key) & mask)
            x = (left << half) | right
            out[todo] = x
            todo[todo] = x >= np.uint64(self.num_samples)
        return out.astype(np.int64)

    def sample_ids(self, global_indices: list[int] | range | np.ndarray) -> list[int]:
        indices = np.asarray(global_indices, dtype=np.int64).reshape(-1)
        if indices.size and int(indices.min()) < 0:
            raise IndexError(f"global sample index must be non-negative, got {int(indices.min())}")
        epochs, positions = np.divmod(indices, self.num_samples)
        out = np.empty_like(indices)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            out[here] = self._permute(positions[here], int(epoch))
        return out.tolist()

    def sample_id(self, global_index: int) -> int:
        return self.sample_ids([global_index])[0]


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
