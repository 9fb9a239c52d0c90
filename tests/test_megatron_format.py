"""Keel's token files against Megatron-Core's own reader and builder, both directions, and Megatron token files
as a corpus (used in place, checked against the tokenizer)."""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import keel.data.indexed as indexed_mod
from keel.data import (
    DataError,
    IndexedDataset,
    IndexedDatasetWriter,
    Tokenizer,
    best_dtype,
    ensure_prepared,
)
from keel.data.tokenizer import train_tokenizer
from tests.test_data_prepare import write_corpus

# "Transformer Engine and Apex are not installed": irrelevant to its data code
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


def _documents(vocab: int, n: int = 40, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, size=int(rng.integers(1, 60))) for _ in range(n)]
    docs[3][0] = vocab - 1
    return docs


def _megatron_build(prefix: Path, docs: list[np.ndarray], dtype: type) -> None:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("vocab", [200, 4096, 70000])
def test_keel_file_reads_in_megatron(tmp_path: Path, vocab: int) -> None:
    docs = _documents(vocab)
    with IndexedDatasetWriter(tmp_path / "k", vocab, eos_id=2) as writer:
        for doc in docs:
            writer.add_document(doc)
    theirs = MegatronDataset(str(tmp_path / "k"))
    assert len(theirs) == len(docs) and theirs.index.dtype == best_dtype(vocab).type
    assert theirs.document_indices.tolist() == list(range(len(docs) + 1))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], doc)
    np.testing.assert_array_equal(np.concatenate(theirs[5:9]), np.concatenate(docs[5:9]))


@pytest.mark.parametrize("vocab", [200, 4096, 70000])
def test_keel_writes_megatrons_bytes(tmp_path: Path, vocab: int) -> None:
    """Byte for byte what Megatron-Core's builder writes for the same documents and dtype."""
    docs = _documents(vocab, seed=1) + [np.zeros(0, dtype=np.int64)]
    _megatron_build(tmp_path / "m", docs, best_dtype(vocab).type)
    with IndexedDatasetWriter(tmp_path / "k", vocab) as writer:
        for doc in docs:
            writer.add_document(doc)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"k{suffix}").read_bytes() == (tmp_path / f"m{suffix}").read_bytes(), (
            suffix
        )


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64, np.int16])
def test_megatron_builder_output_reads_in_keel(tmp_path: Path, dtype: type) -> None:
    docs = _documents(3000, seed=2)
    _megatron_build(tmp_path / "m", docs, dtype)
    # no sidecar: the vocabulary is the caller's
    ours = IndexedDataset(tmp_path / "m", vocab_size=3000)
    assert ours.metadata is None and ours.dtype == np.dtype(dtype) and len(ours) == len(docs)
    assert ours.num_tokens == sum(map(len, docs))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ours[i], doc)
    np.testing.assert_array_equal(ours.tokens, np.concatenate(docs))
    ours.validate()


def test_documents_of_several_sequences(tmp_path: Path) -> None:
    """Megatron's sentence-split files: a document spans several sequences; Keel's document is all of them."""
    builder = IndexedDatasetBuilder(str(tmp_path / "s.bin"), dtype=np.int32)
    builder.add_document(np.array([1, 2, 3, 4, 5]), [2, 3])
    builder.add_document(np.array([6]), [1])
    builder.add_document(np.array([7, 8, 9]), [1, 1, 1])
    builder.finalize(str(tmp_path / "s.idx"))
    ours = IndexedDataset(tmp_path / "s", vocab_size=10)
    assert [ours[i].tolist() for i in range(len(ours))] == [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    assert ours.doc_offsets.tolist() == [0, 5, 6, 9]
    assert [ours.document_start_at(t) for t in (0, 3, 4, 5, 6, 8)] == [0, 0, 0, 5, 6, 6]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    root = tmp_path_factory.mktemp("tok")
    files = write_corpus(root / "corpus")
    return train_tokenizer((f.read_text() for f in files), 400, root / "tokenizer")


def _tokenized(
    prefix: Path, tokenizer: Tokenizer, texts: list[str], extra: list[int] = ()
) -> list[np.ndarray]:
    docs = [np.array(ids + [tokenizer.eos_id]) for ids in tokenizer.encode_batch(texts)]
    docs[-1] = np.concatenate([docs[-1], np.array(extra, dtype=np.int64)])
    _megatron_build(prefix, docs, np.int32)
    return docs


@pytest.mark.parametrize("suffix", ["", ".bin", ".idx"])
def test_megatron_token_file_is_a_corpus_used_in_place(
    tmp_path: Path, tokenizer: Tokenizer, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = _tokenized(
        tmp_path / "pile_text_document", tokenizer, ["hello world", "second document here"]
    )
    spec = [str(tmp_path / f"pile_text_document{suffix}")]
    prepared = ensure_prepared(spec, tmp_path / "cache", 4096, progress=False, tokenizer=tokenizer)
    # not copied
    assert prepared.data_prefix == prepared.sources[0] == tmp_path / "pile_text_document"
    assert (
        prepared.num_tokens == sum(map(len, docs))
        and prepared.vocab_size == tokenizer.vocab_size == 400
    )
    assert not list((tmp_path / "cache").glob("*/*.bin"))  # nothing re-tokenized
    ds = IndexedDataset(prepared.data_prefix, vocab_size=prepared.vocab_size)
    assert tokenizer.decode(ds[1][:-1].tolist()) == "second document here"

    def no_rescan(self: IndexedDataset, vocab_size: int | None = None) -> None:
        raise AssertionError("re-validated despite a complete cache entry")

    monkeypatch.setattr(indexed_mod.IndexedDataset, "validate", no_rescan)
    assert (
        ensure_prepared(spec, tmp_path / "cache", 4096, progress=False, tokenizer=tokenizer)
        == prepared
    )


@pytest.mark.fault(
    "token ids outside the vocabulary", "one line naming file and token; nothing cached"
)
def test_out_of_vocab_token_file_is_one_line(tmp_path: Path, tokenizer: Tokenizer) -> None:
    _tokenized(tmp_path / "foreign", tokenizer, ["fine", "ends badly"], extra=[7, 400])
    with pytest.raises(
        DataError,
        match=r"foreign\.bin: token \d+ is id 400, outside the tokenizer's vocabulary"
        r" \[0, 400\)",
    ) as info:
        ensure_prepared(
            [str(tmp_path / "foreign")],
            tmp_path / "cache",
            4096,
            progress=False,
            tokenizer=tokenizer,
        )
    assert "\n" not in str(info.value)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # no half-made entry


@pytest.mark.parametrize(
    ("make", "entry", "match"),
    [
        (["x.bin"], "x.bin", r"names a token file but .*x\.idx is missing"),
        (["x.idx"], "x", r"names a token file but .*x\.bin is missing"),
        ([], "nothing_here", r"no files match '.*nothing_here'"),
    ],
)
def test_bad_prefix_is_one_line(
    tmp_path: Path, tokenizer: Tokenizer, make: list[str], entry: str, match: str
) -> None:
    for name in make:
        (tmp_path / name).write_bytes(b"\0" * 8)
    with pytest.raises(DataError, match=match) as info:
        ensure_prepared(
            [str(tmp_path / entry)], tmp_path / "cache", 4096, progress=False, tokenizer=tokenizer
        )
    assert "\n" not in str(info.value)


@pytest.mark.fault("truncated Megatron token file", "one line naming the file and sizes")
def test_truncated_megatron_file_is_one_line(tmp_path: Path, tokenizer: Tokenizer) -> None:
    _tokenized(tmp_path / "t", tokenizer, ["some text", "more text"])
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[:-4])
    with pytest.raises(
        DataError, match=r"t\.bin: re-run `keel prepare` to rebuild it \(holds \d+ bytes, its index"
    ):
        ensure_prepared(
            [str(tmp_path / "t")], tmp_path / "cache", 4096, progress=False, tokenizer=tokenizer
        )


def test_token_file_without_tokenizer_is_refused(tmp_path: Path, tokenizer: Tokenizer) -> None:
    _tokenized(tmp_path / "t", tokenizer, ["some text"])
    with pytest.raises(
        DataError, match=r"t is a token file, whose ids mean something only with the tokenizer"
    ):
        ensure_prepared([str(tmp_path / "t")], tmp_path / "cache", 4096, progress=False)


def test_directory_of_token_files_and_sidecars(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """Inside a directory a .bin/.idx pair (and Keel's .json sidecar beside it) is a token file, not text."""
    (tmp_path / "d").mkdir()
    _tokenized(tmp_path / "d" / "a", tokenizer, ["first"])
    IndexedDatasetWriter(tmp_path / "d" / "b", 400).finalize()  # with a sidecar b.json
    prepared = ensure_prepared(
        [str(tmp_path / "d")], tmp_path / "cache", 4096, progress=False, tokenizer=tokenizer
    )
    assert prepared.sources == (tmp_path / "d" / "a", tmp_path / "d" / "b")
    glob_only_bins = ensure_prepared(
        [str(tmp_path / "d" / "*.bin")],
        tmp_path / "cache",
        4096,
        progress=False,
        tokenizer=tokenizer,
    )
    assert glob_only_bins.sources == prepared.sources
    (tmp_path / "d" / "orphan.bin").write_bytes(b"\0\0")
    with pytest.raises(DataError, match=r"orphan\.bin has no .*orphan\.idx beside it"):
        ensure_prepared(
            [str(tmp_path / "d")], tmp_path / "cache", 4096, progress=False, tokenizer=tokenizer
        )
