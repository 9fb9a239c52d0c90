"""The blend index: realised shares follow the weights, the order is deterministic and prefix-stable, and
step batches come from the right sources."""

from pathlib import Path

import numpy as np
import pytest

from keel.data import DataError, step_batch
from keel.data.blend import (
    BlendedOrder,
    BlendedSamples,
    blend_block,
    build_blend,
    ensure_blend_index,
    normalized_weights,
    realised_shares,
)


class FakeSource:
    """`n` windows whose every token is `tag * 1000 + window index`: a window names its source and id."""

    def __init__(self, n: int, tag: int) -> None:
        self.n, self.tag = n, tag

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        assert 0 <= i < self.n
        return np.full(5, self.tag * 1000 + i, dtype=np.int64)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [1, 1, 1, 1], [0.01, 0.99]])
def test_realised_shares_within_one_point_over_10k(weights: list[float]) -> None:
    w = normalized_weights(weights)
    index = build_blend(w, 10_000)
    shares = realised_shares(index, len(w), 10_000)
    assert np.max(np.abs(np.array(shares) - w)) < 0.01
    # the deficit stays bounded at every prefix, not just at the end
    counts = np.cumsum(np.eye(len(w))[index["source"]], axis=0)
    lag = np.abs(counts - np.arange(1, 10_001)[:, None] * w)
    assert lag.max() <= 0.5 + len(w) / 2 + 1e-9
    # ordinals count each source's samples in order
    for s in range(len(w)):
        np.testing.assert_array_equal(
            index["ordinal"][index["source"] == s], np.arange(int(counts[-1, s]))
        )


def test_same_weights_same_order_and_prefix_stable() -> None:
    w = normalized_weights([0.6, 0.25, 0.15])
    a, b = build_blend(w, 5000), build_blend(w, 5000)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(build_blend(w, 777), a[:777])
    # block by block from the counts gives the same as one block
    src, ordn = blend_block(w, np.zeros(3, np.int64), 3000)
    counts = np.bincount(src, minlength=3)
    src2, ordn2 = blend_block(w, counts, 2000)
    np.testing.assert_array_equal(np.concatenate([src, src2]), a["source"])
    np.testing.assert_array_equal(np.concatenate([ordn, ordn2]), a["ordinal"])
    assert not np.array_equal(build_blend(normalized_weights([0.5, 0.3, 0.2]), 5000), a)


def test_bad_weights_are_one_line() -> None:
    for bad in ([0.5, 0.0], [-1, 2], [], [float("nan")]):
        with pytest.raises(DataError, match="weights must be positive"):
            normalized_weights(bad)


def test_index_is_cached_atomically(tmp_path: Path) -> None:
    w = normalized_weights([0.7, 0.3])
    path = ensure_blend_index(tmp_path / "blend.npy", w, 1000)
    mtime = path.stat().st_mtime_ns
    # long enough: reused
    assert ensure_blend_index(path, w, 500) == path and path.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(np.load(path, mmap_mode="r"), build_blend(w, 1000))
    path.write_bytes(b"garbage")
    ensure_blend_index(path, w, 1000)
    np.testing.assert_array_equal(np.load(path), build_blend(w, 1000))
    assert [p.name for p in tmp_path.iterdir()] == ["blend.npy"]  # no temp files left behind


def test_blended_batches_follow_the_index_and_wrap_small_sources() -> None:
    w = normalized_weights([0.8, 0.2])
    sources = [
        FakeSource(500, 1),
        FakeSource(7, 2),
    ]  # the second source is far smaller than its share
    samples = BlendedSamples(sources)
    index = build_blend(w, 100)  # short horizon: later steps extend it in memory
    order = BlendedOrder(index, w, samples, seed=3)
    rows = np.concatenate([b.numpy() for b in step_batch(order, samples, 0, 400, 4, 0, 1)])
    tags = rows[:, 0] // 1000
    np.testing.assert_array_equal(tags, build_blend(w, 400)["source"] + 1)
    small = rows[tags == 2, 0] % 1000
    # each epoch of the small source is a permutation
    assert len(small) == 80 and sorted(small[:7]) == list(range(7))
    assert not np.array_equal(small[:7], small[7:14])  # reshuffled per epoch
    # the same (seed, weights) in a fresh order, from the middle: the same samples (exact resume)
    again = BlendedOrder(build_blend(w, 100), w, samples, seed=3)
    assert again.sample_ids(range(200, 240)) == order.sample_ids(range(200, 240))
    assert BlendedOrder(index, w, samples, seed=4).sample_ids(range(40)) != order.sample_ids(
        range(40)
    )
