"""Weighted blending of several sources: which source, and which of its samples, each global sample is.

A Megatron-style blend index, vectorized: source s's k-th sample is *due* at (k + 1/2) / w_s, and samples are
taken in due order (ties: the lower source first). This is the largest-deficit rule in closed form — after n
samples every source's count is within 1/2 + S/2 · w_s of n · w_s (S sources) — and it is prefix-stable, so the
index can be built block by block in bounded memory and the first n entries never depend on the horizon.
Everything is a pure function of the weights; the within-source order is each source's own permutation per
epoch of that source (from (seed, source, epoch)), so a source smaller than its share wraps around reshuffled.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from keel.data.errors import DataError
from keel.data.samples import GlobalSampleOrder
from keel.run_dir import temp_sibling

BLEND_DTYPE = np.dtype([("source", "<u2"), ("ordinal", "<i8")])
_BLOCK = 1 << 20  # samples built per vectorized block: bounds the temporaries (~40 B per sample)


def normalized_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise DataError(f"data.corpus: weights must be positive numbers, got {list(weights)}")
    return w / w.sum()


def blend_block(
    weights: np.ndarray, counts: np.ndarray, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The next `size` entries after `counts` samples per source: (source, ordinal within that source)."""
    n_sources = weights.size
    # a block of `size` takes at most (size + S) · w_s + 2 from source s (see the module docstring)
    take = np.ceil((size + n_sources) * weights).astype(np.int64) + 3
    ordinals = np.concatenate(
        [counts[s] + np.arange(take[s], dtype=np.int64) for s in range(n_sources)]
    )
    sources = np.repeat(np.arange(n_sources, dtype=np.uint16), take)
    due = (ordinals + 0.5) / weights[sources]
    pick = np.lexsort((sources, due))[:size]
    chosen = np.bincount(sources[pick], minlength=n_sources)
    # the candidate bound failed: the block would not be the exact prefix
    if np.any(chosen >= take):
        raise RuntimeError(
            f"blend block under-provisioned: took {chosen.tolist()} of {take.tolist()}"
        )
    return sources[pick], ordinals[pick]


def build_blend(weights: np.ndarray, num_samples: int, out: np.ndarray | None = None) -> np.ndarray:
    """The first `num_samples` entries of the blend (BLEND_DTYPE), built block by block into `out`."""
    out = np.empty(num_samples, BLEND_DTYPE) if out is None else out
    counts = np.zeros(weights.size, dtype=np.int64)
    for start in range(0, num_samples, _BLOCK):
        size = min(_BLOCK, num_samples - start)
        src, ordinal = blend_block(weights, counts, size)
        out["source"][start : start + size] = src
        out["ordinal"][start : start + size] = ordinal
        counts += np.bincount(src, minlength=weights.size)
    return out


def ensure_blend_index(path: Path, weights: np.ndarray, num_samples: int) -> Path:
    """Build the index into `path` (.npy) unless a complete one of at least `num_samples` is there; atomic."""
    path = Path(path)
    if path.is_file():
        try:
            if len(np.load(path, mmap_mode="r")) >= num_samples:
                return path
        except (OSError, ValueError):
            pass  # damaged: rebuild it
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path).with_suffix(".npy")
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=BLEND_DTYPE, shape=(num_samples,))
        build_blend(weights, num_samples, out)
        out.flush()
        del out
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def realised_shares(index: np.ndarray, n_sources: int, num_samples: int) -> list[float]:
    counts = np.bincount(np.asarray(index["source"][:num_samples]), minlength=n_sources)
    return (counts / max(num_samples, 1)).tolist()


class BlendedSamples:
    """The sources' windows as one flat id space: id = offset of its source + window index within it."""

    def __init__(self, sources: Sequence) -> None:
        if not sources:
            raise DataError("data.corpus: a blend needs at least one source")
        self.sources = list(sources)
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in self.sources])]).astype(
            np.int64
        )

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def vocab_size(self) -> int:
        return max(source.vocab_size for source in self.sources)

    def _split(self, flat_id: int) -> tuple[object, int]:
        source = int(np.searchsorted(self.offsets, flat_id, side="right") - 1)
        return self.sources[source], int(flat_id - self.offsets[source])

    def __getitem__(self, flat_id: int) -> np.ndarray:
        source, i = self._split(flat_id)
        return source[i]

    def window(self, flat_id: int) -> np.ndarray:
        source, i = self._split(flat_id)
        return source.window(i)

    def origin(self, flat_id: int) -> tuple[object, int]:
        source, i = self._split(flat_id)
        return source.origin(i)


class BlendedOrder:
    """Global sample index → flat sample id of a `BlendedSamples`, through the blend index (a GlobalSampleOrder
    drop-in: `num_samples`, `sample_id(s)`); beyond the cached horizon the blend continues in memory."""

    def __init__(
        self, index: np.ndarray, weights: np.ndarray, samples: BlendedSamples, seed: int
    ) -> None:
        self.index, self.weights, self.samples = index, weights, samples
        self.num_samples = len(samples)
        self.orders = [
            GlobalSampleOrder(len(s), seed, stream=i) for i, s in enumerate(samples.sources)
        ]

    def _entries(self, global_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if global_indices.size and int(global_indices.max()) >= len(self.index):
            self.index = build_blend(
                self.weights, max(2 * len(self.index), int(global_indices.max()) + 1)
            )
        rows = self.index[global_indices]
        return rows["source"], rows["ordinal"]

    def sample_ids(self, global_indices: Sequence[int] | range) -> list[int]:
        gi = np.asarray(list(global_indices), dtype=np.int64)
        if gi.size and gi.min() < 0:
            raise IndexError(f"global sample index must be non-negative, got {int(gi.min())}")
        sources, ordinals = self._entries(gi)
        return [
            int(self.samples.offsets[s]) + self.orders[s].sample_id(int(o))
            for s, o in zip(sources, ordinals)
        ]

    def sample_id(self, global_index: int) -> int:
        return self.sample_ids([global_index])[0]
