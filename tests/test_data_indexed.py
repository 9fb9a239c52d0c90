"""The .bin/.idx token store: round trips, dtype choice, and corruption detection."""

import pickle

import numpy as np
import pytest

from keel.data import DataError, IndexedDataset, IndexedDatasetWriter, best_dtype


@pytest.mark.parametrize(
    ("vocab", "dtype"),
    [(2, np.uint8), (256, np.uint8), (257, np.uint16), (4096, np.uint16), (65536, np.uint16), (70000, np.uint32)],
)
def test_best_dtype(vocab: int, dtype: type) -> None:
    assert best_dtype(vocab) == np.dtype(dtype)


@pytest.mark.parametrize(("vocab", "dtype"), [(4096, np.uint16), (70000, np.uint32)])
def test_round_trip(tmp_path, vocab: int, dtype: type) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab, size=n) for n in (5, 0, 17, 1, 300)]
    docs[2][0] = vocab - 1
    with IndexedDatasetWriter(tmp_path / "d", vocab) as writer:
        for doc in docs:
            writer.add_document(doc.tolist())
    ds = IndexedDataset(tmp_path / "d")
    assert ds.tokens.dtype == np.dtype(dtype)
    assert (tmp_path / "d.bin").stat().st_size == ds.num_tokens * np.dtype(dtype).itemsize
    assert len(ds) == len(docs) and ds.vocab_size == vocab and ds.num_tokens == sum(map(len, docs))
    assert ds.doc_offsets.tolist() == np.concatenate([[0], np.cumsum([len(d) for d in docs])]).tolist()
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    np.testing.assert_array_equal(ds[-1], docs[-1])
    with pytest.raises(IndexError):
        ds[len(docs)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(ds))[4], docs[4])


def test_empty_dataset(tmp_path) -> None:
    IndexedDatasetWriter(tmp_path / "e", 10).finalize()
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_tokens == 0


@pytest.mark.parametrize("bad", [[1, 2, 500], [3, -1]])
def test_out_of_vocab_ids_raise(tmp_path, bad: list[int]) -> None:
    writer = IndexedDatasetWriter(tmp_path / "d", 500)
    with pytest.raises(DataError, match="outside the vocabulary"):
        writer.add_document(bad)
    writer.abort()


def test_failure_inside_context_leaves_nothing(tmp_path) -> None:
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "d", 100) as writer:
        writer.add_document([1, 2, 3])
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def written(tmp_path):
    with IndexedDatasetWriter(tmp_path / "d", 1000) as writer:
        for n in (10, 20, 30):
            writer.add_document(list(range(n)))
    return tmp_path / "d"


def _rewrite(path, edit) -> None:
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(edit(data)))


@pytest.mark.parametrize(
    ("suffix", "edit"),
    [
        (".idx", lambda b: b"NOTKEEL\0" + b[8:]),  # wrong magic
        (".idx", lambda b: b[:8] + b"\x63\x00\x00\x00" + b[12:]),  # unknown version
        (".idx", lambda b: b[:20]),  # truncated header
        (".idx", lambda b: b[:-8]),  # truncated offsets
        (".bin", lambda b: b[:-2]),  # truncated tokens
        (".bin", lambda b: b + b"\0\0"),  # tokens beyond the index
    ],
)
def test_corrupt_files_raise(written, suffix: str, edit) -> None:
    _rewrite(written.with_name(written.name + suffix), edit)
    with pytest.raises(DataError, match="keel prepare"):
        IndexedDataset(written)


@pytest.mark.parametrize("suffix", [".idx", ".bin"])
def test_missing_files_raise(written, suffix: str) -> None:
    written.with_name(written.name + suffix).unlink()
    with pytest.raises(DataError, match=r"missing; re-run `keel prepare`"):
        IndexedDataset(written)
