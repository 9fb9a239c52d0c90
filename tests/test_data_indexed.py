"""The .bin/.idx/.json token file (Megatron layout + Keel sidecar): round trips, dtype choice, corruption."""

import pickle

import numpy as np
import pytest

from keel.data import DataError, IndexedDataset, IndexedDatasetWriter, best_dtype


@pytest.mark.parametrize(
    ("vocab", "dtype"),
    [
        (2, np.uint8),
        (256, np.uint8),
        (257, np.uint16),
        (4096, np.uint16),
        (65536, np.uint16),
        (70000, np.int32),
        (2**31, np.int32),
    ],
)
def test_best_dtype(vocab: int, dtype: type) -> None:
    assert best_dtype(vocab) == np.dtype(dtype)


@pytest.mark.parametrize(
    ("vocab", "dtype"), [(200, np.uint8), (4096, np.uint16), (70000, np.int32)]
)
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
    assert (
        ds.doc_offsets.tolist() == np.concatenate([[0], np.cumsum([len(d) for d in docs])]).tolist()
    )
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    np.testing.assert_array_equal(ds[-1], docs[-1])
    with pytest.raises(IndexError):
        ds[len(docs)]
    assert (
        ds.document_start_at(0) == 0
        and ds.document_start_at(ds.num_tokens - 1) == ds.doc_offsets[-2]
    )
    # documents start at 0 5 5 22 23
    assert ds.document_start_at(22) == 22 and ds.document_start_at(21) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "d.bin",
        "d.idx",
        "d.json",
    ]  # no temporaries left
    assert ds.metadata["num_docs"] == 5 and ds.metadata["vocab_size"] == vocab
    ds.validate()
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(ds))[4], docs[4])


def test_best_dtype_refuses_too_large_vocab() -> None:
    with pytest.raises(DataError, match="out of range"):
        best_dtype(2**31 + 1)


def test_bulk_add_matches_one_by_one(tmp_path) -> None:
    docs = [[1, 2, 3], [], [4], [5, 6]]
    with IndexedDatasetWriter(tmp_path / "one", 10) as writer:
        for doc in docs:
            writer.add_document(doc)
    with IndexedDatasetWriter(tmp_path / "bulk", 10) as writer:
        writer.add_documents(np.array([1, 2, 3, 4]), np.array([3, 0, 1]))
        writer.add_documents(np.array([5, 6]), np.array([2]))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"bulk{suffix}").read_bytes()
    with (
        pytest.raises(DataError, match="document 5: token id 10 is outside"),
        IndexedDatasetWriter(tmp_path / "bad", 10) as writer,
    ):
        writer.add_documents(np.array([1, 2, 3, 4, 10]), np.array([4, 0, 0, 0, 0, 1]))


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
    assert list(tmp_path.iterdir()) == []


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
    ("suffix", "edit", "match"),
    [
        (".idx", lambda b: b"NOTMEGA\0\0" + b[9:], "no MMIDIDX header"),  # wrong magic
        (".idx", lambda b: b[:9] + b"\x63" + b[10:], "index version 99"),  # unknown version
        (".idx", lambda b: b[:17] + b"\x09" + b[18:], "unknown token dtype code 9"),
        (".idx", lambda b: b[:17] + b"\x07" + b[18:], "float32 values, not token ids"),
        (".idx", lambda b: b[:20], "truncated header"),
        (".idx", lambda b: b[:-8], "size .* does not match"),  # truncated document indices
        (".idx", lambda b: b[:-8] + (2).to_bytes(8, "little"), "document indices run 0..2"),
        (".bin", lambda b: b[:-2], "holds 118 bytes, its index expects 120"),  # truncated tokens
        (".bin", lambda b: b + b"\0\0", "holds 122 bytes"),  # tokens beyond the index
        (
            ".json",
            lambda b: b.replace(b'"num_docs": 3', b'"num_docs": 4'),
            "records 60 tokens in 4 documents",
        ),
        (".json", lambda b: b[:10], "not valid JSON"),
    ],
)
@pytest.mark.fault(
    "corrupt .bin/.idx/sidecar token file", "one line naming the file and the mismatch"
)
def test_corrupt_files_raise_one_line(written, suffix: str, edit, match: str) -> None:
    _rewrite(written.with_name(written.name + suffix), edit)
    with pytest.raises(DataError, match=match) as info:
        IndexedDataset(written)
    assert "\n" not in str(info.value) and str(written) in str(info.value)


def test_validate_finds_what_opening_does_not_look_at(written) -> None:
    """Opening checks sizes and end points only; validate() streams pointers, documents and ids."""
    idx = written.with_name(written.name + ".idx")
    # header + int32 lengths; the second pointer says 'sequence 1 starts at byte 4'
    pointers = 34 + 4 * 3
    _rewrite(idx, lambda b: b[: pointers + 8] + (4).to_bytes(8, "little") + b[pointers + 16 :])
    with pytest.raises(DataError, match="pointers do not follow the sequence lengths"):
        IndexedDataset(written).validate()
    # repaired
    _rewrite(idx, lambda b: b[: pointers + 8] + (20).to_bytes(8, "little") + b[pointers + 16 :])
    IndexedDataset(written).validate()
    with pytest.raises(
        DataError, match=r"token 55 is id 25, outside the tokenizer's vocabulary \[0, 25\)"
    ):
        IndexedDataset(written).validate(vocab_size=25)


def test_file_without_sidecar_takes_the_callers_vocabulary(written) -> None:
    written.with_name(written.name + ".json").unlink()
    with pytest.raises(DataError, match=r"no sidecar .*d\.json records its vocabulary"):
        IndexedDataset(written)
    ds = IndexedDataset(f"{written}.bin", vocab_size=1234)  # the extension is optional
    assert ds.vocab_size == 1234 and ds.metadata is None and len(ds) == 3
    assert pickle.loads(pickle.dumps(ds)).vocab_size == 1234


@pytest.mark.parametrize("suffix", [".idx", ".bin"])
@pytest.mark.fault("token file missing", "one line naming it and how to rebuild")
def test_missing_files_raise(written, suffix: str) -> None:
    written.with_name(written.name + suffix).unlink()
    with pytest.raises(DataError, match=r"missing; re-run `keel prepare`"):
        IndexedDataset(written)
