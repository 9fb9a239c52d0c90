"""End-to-end preparation and the prepared-corpus cache."""

import random
import time
from pathlib import Path

import pytest

import keel.data.prepare as prepare_mod
from keel.data import (
    DataError,
    IndexedDataset,
    PackedSamples,
    default_corpus_files,
    ensure_prepared,
    iter_documents,
    load_tokenizer,
    prepare_corpus,
)


def write_corpus(root: Path, n_files: int = 12, seed: int = 0) -> list[Path]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(300)]
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n_files):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(10, 60))]
        path = root / f"doc{i:02d}.txt"
        path.write_text("\n".join(lines) + "\n")
        files.append(path)
    (root / "empty.txt").write_text("")
    return files


def test_prepare_corpus_round_trips_documents(tmp_path: Path) -> None:
    files = write_corpus(tmp_path / "corpus") + [tmp_path / "corpus" / "empty.txt"]
    prepared = prepare_corpus(files, tmp_path / "out", 400, progress=False)
    tok = load_tokenizer(prepared.tokenizer_path)
    ds = IndexedDataset(prepared.data_prefix)
    docs = list(iter_documents(files))
    assert prepared.num_docs == len(ds) == len(docs) == 12
    assert prepared.num_tokens == ds.num_tokens and ds.vocab_size == 400
    for i, doc in enumerate(docs):
        assert ds[i][-1] == tok.eos_id
        assert tok.decode(ds[i][:-1].tolist()) == doc


def test_empty_corpus_raises(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="contain no text"):
        prepare_corpus([empty], tmp_path / "out", 400, progress=False)
    with pytest.raises(DataError, match="contain no text"):
        ensure_prepared([str(empty)], tmp_path / "cache", 400, progress=False)


def test_ensure_prepared_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    first = ensure_prepared(["corpus/*.txt"], cache, 400, base_dir=tmp_path, progress=False)
    assert (first.data_prefix.parent / "done.json").is_file()

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("retrained despite a complete cache entry")

    def no_tokenizing(*args: object, **kwargs: object) -> None:
        raise AssertionError("re-tokenized despite a complete cache entry")

    monkeypatch.setattr(prepare_mod, "load_or_train_tokenizer", no_training)
    monkeypatch.setattr(prepare_mod, "prepare_corpus", no_tokenizing)
    second = ensure_prepared(["corpus/*.txt"], cache, 400, base_dir=tmp_path, progress=False)
    assert second == first
    assert [p.name for p in cache.iterdir()] == [first.data_prefix.parent.name]  # no temp dirs left over
    monkeypatch.undo()

    # Anything the output depends on changes the key.
    assert ensure_prepared(["corpus/*.txt"], cache, 300, base_dir=tmp_path, progress=False) != first
    (tmp_path / "corpus" / "doc00.txt").write_text("changed text\n" * 50)
    changed = ensure_prepared(["corpus/*.txt"], cache, 400, base_dir=tmp_path, progress=False)
    assert changed.data_prefix.parent != first.data_prefix.parent


def test_damaged_entry_is_rebuilt(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus")
    args = (["corpus/*.txt"], tmp_path / "cache", 400)
    first = ensure_prepared(*args, base_dir=tmp_path, progress=False)
    Path(f"{first.data_prefix}.bin").write_bytes(b"")
    again = ensure_prepared(*args, base_dir=tmp_path, progress=False)
    assert again == first and IndexedDataset(again.data_prefix).num_tokens == first.num_tokens


def test_losing_a_race_keeps_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_corpus(tmp_path / "corpus")
    args = (["corpus/*.txt"], tmp_path / "cache", 400)
    real_prepare = prepare_mod.prepare_corpus
    winner = {}

    def racing_prepare(*a: object, **k: object) -> object:
        # While this process prepares, "another process" finishes first and renames its entry into place.
        monkeypatch.setattr(prepare_mod, "prepare_corpus", real_prepare)
        winner["entry"] = ensure_prepared(*args, base_dir=tmp_path, progress=False)
        return real_prepare(*a, **k)

    monkeypatch.setattr(prepare_mod, "prepare_corpus", racing_prepare)
    result = ensure_prepared(*args, base_dir=tmp_path, progress=False)
    assert result == winner["entry"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [result.data_prefix.parent.name]


@pytest.mark.slow
def test_default_corpus_prepares(tmp_path: Path) -> None:
    start = time.perf_counter()
    prepared = ensure_prepared(["default"], tmp_path / "cache", 4096, progress=False)
    elapsed = time.perf_counter() - start
    ds = IndexedDataset(prepared.data_prefix)
    assert ds.num_tokens == prepared.num_tokens > 1_000_000
    assert 0 < len(ds) <= len(default_corpus_files())
    assert len(PackedSamples(ds, 128, "val", 0.01)) > 0
    print(f"default corpus: {len(ds)} docs, {ds.num_tokens:,} tokens, prepared in {elapsed:.1f}s")
