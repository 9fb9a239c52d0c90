"""Packing, the train/val split, the global sample order, and per-rank step batches."""

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from keel.data import (
    DataError,
    GlobalSampleOrder,
    IndexedDataset,
    IndexedDatasetWriter,
    PackedSamples,
    step_batch,
    step_sample_indices,
)

VOCAB = 1 << 20  # large enough that every token can be its own stream position


def positional_dataset(path: Path, doc_lengths: list[int]) -> IndexedDataset:
    """A dataset whose token at stream position p is p, so windows can be checked by value."""
    with IndexedDatasetWriter(path / "d", VOCAB) as writer:
        start = 0
        for n in doc_lengths:
            writer.add_document(np.arange(start, start + n))
            start += n
    return IndexedDataset(path / "d")


@pytest.fixture
def dataset(tmp_path: Path) -> IndexedDataset:
    rng = np.random.default_rng(0)
    return positional_dataset(tmp_path, rng.integers(1, 200, size=100).tolist())


def test_windows_are_contiguous_and_shifted(dataset: IndexedDataset) -> None:
    seq = 16
    train = PackedSamples(dataset, seq, "train", 0.1)
    assert len(train) == (train.num_tokens - 1) // seq
    for i in (0, 1, len(train) // 2, len(train) - 1):
        sample = train[i]
        assert sample.dtype == np.int64 and sample.shape == (seq + 1,)
        np.testing.assert_array_equal(sample, np.arange(i * seq, i * seq + seq + 1))
        inputs, labels = sample[:-1], sample[1:]
        np.testing.assert_array_equal(labels[:-1], inputs[1:])
    assert train[len(train) - 1][-1] < train.end
    with pytest.raises(IndexError):
        train[len(train)]


def test_train_and_val_are_disjoint(dataset: IndexedDataset) -> None:
    train = PackedSamples(dataset, 16, "train", 0.1)
    val = PackedSamples(dataset, 16, "val", 0.1)
    assert val.start == train.end and val.end == dataset.num_tokens
    assert val.start in dataset.doc_offsets.tolist()  # starts at a document boundary
    assert val.num_tokens >= 0.1 * dataset.num_tokens
    train_tokens = np.concatenate([train[i] for i in range(len(train))])
    val_tokens = np.concatenate([val[i] for i in range(len(val))])
    assert train_tokens.max() < val.start <= val_tokens.min()
    np.testing.assert_array_equal(val[0][:3], np.arange(val.start, val.start + 3))


def test_single_document_splits_mid_document(tmp_path: Path) -> None:
    ds = positional_dataset(tmp_path, [1000])
    train, val = PackedSamples(ds, 10, "train", 0.05), PackedSamples(ds, 10, "val", 0.05)
    assert train.end == val.start == 950 and len(val) == 4


def test_tiny_val_fraction_still_gets_one_window(dataset: IndexedDataset) -> None:
    assert len(PackedSamples(dataset, 64, "val", 1e-9)) >= 1


def test_too_small_corpus_says_how_many_tokens(tmp_path: Path) -> None:
    ds = positional_dataset(tmp_path, [50, 50])
    with pytest.raises(DataError, match=r"100 tokens, too few for seq_len=128 .*needs about 258"):
        PackedSamples(ds, 128, "train", 0.01)


def test_zero_val_fraction(dataset: IndexedDataset) -> None:
    assert PackedSamples(dataset, 16, "train", 0.0).end == dataset.num_tokens
    with pytest.raises(DataError, match="no validation split"):
        PackedSamples(dataset, 16, "val", 0.0)


def test_global_order_is_deterministic_permutation_per_epoch() -> None:
    n = 37
    a, b = GlobalSampleOrder(n, seed=7), GlobalSampleOrder(n, seed=7)
    epochs = [[a.sample_id(e * n + i) for i in range(n)] for e in range(4)]
    assert [b.sample_id(g) for g in reversed(range(4 * n))] == [s for ep in epochs for s in ep][
        ::-1
    ]
    for ep in epochs:
        assert sorted(ep) == list(range(n))
    assert epochs[0] != epochs[1]
    # the order "feistel-v1" (data.json records it): pinned, as a resume depends on it
    assert epochs[2][:10] == [34, 32, 21, 10, 30, 15, 33, 27, 0, 29]
    assert [GlobalSampleOrder(n, seed=8).sample_id(i) for i in range(n)] != epochs[0]
    assert [GlobalSampleOrder(n, seed=7, stream=1).sample_id(i) for i in range(n)] != epochs[0]


@pytest.mark.parametrize("n", [1, 2, 3, 255, 256, 257, 4097, 100_003])
def test_every_epoch_is_a_permutation_of_any_size(n) -> None:
    order = GlobalSampleOrder(n, seed=3)
    for epoch in range(2):
        assert sorted(order.sample_ids(range(epoch * n, (epoch + 1) * n))) == list(range(n))


def test_the_order_holds_no_per_sample_state_and_looks_random() -> None:
    """10^13 tokens in windows of 2,048: no rank stores a permutation, and each id costs microseconds."""
    n = 10**13 // 2048
    order = GlobalSampleOrder(n, seed=1234)
    assert order.sample_ids([0, 1, n - 1, 10**9]) == order.sample_ids([0, 1, n - 1, 10**9])
    held = sum(v.nbytes if isinstance(v, np.ndarray) else 8 for v in vars(order).values())
    assert held < 1024  # nothing that grows with the corpus
    assert all(0 <= i < n for i in order.sample_ids(range(5 * n - 100, 5 * n + 100)))
    m = 100_003
    ids = np.array(GlobalSampleOrder(m, seed=3).sample_ids(range(m)))
    assert abs(np.corrcoef(ids, np.arange(m))[0, 1]) < 0.02  # no trace of the input order
    gaps = np.abs(np.diff(ids)) / m
    assert 0.27 < float(np.median(gaps)) < 0.32  # a uniform shuffle's: 1 - 1/sqrt(2)


def _ids(
    order: GlobalSampleOrder, batches: list[torch.Tensor], samples: PackedSamples
) -> list[int]:
    """Recover sample ids from batch rows (positional tokens make each row identify its window)."""
    return [int(row[0]) // samples.seq_len for mb in batches for row in mb]


@pytest.mark.parametrize("consumed", [0, 48, 1000])
def test_step_is_identical_across_world_sizes(dataset: IndexedDataset, consumed: int) -> None:
    samples = PackedSamples(dataset, 16, "train", 0.1)
    order = GlobalSampleOrder(len(samples), seed=3)
    gb, mb = 16, 2
    expected_indices = list(range(consumed, consumed + gb))
    expected_ids = order.sample_ids(expected_indices)
    assert step_sample_indices(consumed, gb, mb) == expected_indices
    for dp in (1, 2, 4):
        indices, ids, rows = [], [], []
        for rank in range(dp):
            indices += step_sample_indices(consumed, gb, mb, rank, dp)
            batches = step_batch(order, samples, consumed, gb, mb, rank, dp)
            assert len(batches) == gb // dp // mb
            for b in batches:
                assert b.dtype == torch.long and b.shape == (mb, 17)
            ids += _ids(order, batches, samples)
            rows += [row for b in batches for row in b]
        assert indices == expected_indices
        assert ids == expected_ids and Counter(ids) == Counter(expected_ids)
        assert torch.equal(
            torch.stack(rows), torch.from_numpy(np.stack([samples[i] for i in expected_ids]))
        )


def test_consecutive_steps_cover_an_epoch_without_repeats(tmp_path: Path) -> None:
    samples = PackedSamples(positional_dataset(tmp_path, [64 * 8 + 1]), 8, "train", 0.0)
    assert len(samples) == 64
    order = GlobalSampleOrder(len(samples), seed=0)
    gb = 16
    for epoch in range(2):
        seen = []
        for step in range(4):
            consumed = (epoch * 4 + step) * gb
            for rank in range(2):
                seen += _ids(order, step_batch(order, samples, consumed, gb, 4, rank, 2), samples)
        assert sorted(seen) == list(range(64))


def test_batch_geometry_must_divide(dataset: IndexedDataset) -> None:
    samples = PackedSamples(dataset, 16, "train", 0.1)
    order = GlobalSampleOrder(len(samples), seed=0)
    with pytest.raises(
        DataError, match=r"multiple of train.micro_batch_size x data-parallel size \(4 x 3 = 12\)"
    ):
        step_batch(order, samples, 0, 16, 4, 0, 3)


def test_out_of_range_token_id_stops_with_the_file_and_sample(tmp_path: Path) -> None:
    """A corrupt .bin (the writer refuses such ids, so the bytes are changed behind its back): reading the window
    that holds the foreign id names the file and the sample; every other window still reads."""
    with IndexedDatasetWriter(tmp_path / "d", 1000) as writer:
        for _ in range(20):
            writer.add_document(np.arange(100) % 1000)
    bin_path = tmp_path / "d.bin"
    tokens = np.fromfile(bin_path, dtype=np.uint16)
    tokens[16 * 3 + 5] = 4321  # inside train sample 3 (windows of 17 tokens start every 16)
    tokens.tofile(bin_path)
    samples = PackedSamples(IndexedDataset(tmp_path / "d"), 16, "train", 0.1)
    assert samples[2].max() < 1000 and samples[4].max() < 1000
    with pytest.raises(
        DataError,
        match=r"d\.bin: train sample 3 \(tokens 48\.\.64\) holds token id 4321, outside "
        r"the vocabulary \[0, 1000\)",
    ):
        samples[3]
