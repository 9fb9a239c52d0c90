"""End-to-end preparation and the prepared-corpus cache."""

import os
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
from keel.data.tokenizer import Tokenizer, train_tokenizer


def write_corpus(root: Path, n_files: int = 12, seed: int = 0) -> list[Path]:
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
        for _ in range(300)
    ]
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n_files):
        lines = [
            " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
            for _ in range(rng.randint(10, 60))
        ]
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
    assert [p.name for p in cache.iterdir()] == [
        first.data_prefix.parent.name
    ]  # no temp dirs left over
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


@pytest.fixture(scope="module")
def given_tokenizer(tmp_path_factory) -> Tokenizer:
    root = tmp_path_factory.mktemp("given")
    return train_tokenizer(
        (f.read_text() for f in write_corpus(root / "corpus")), 400, root / "tokenizer"
    )


def _token_bytes(prefix: Path) -> dict[str, bytes]:
    return {suffix: Path(f"{prefix}{suffix}").read_bytes() for suffix in (".bin", ".idx", ".json")}


def test_workers_write_byte_identical_files(
    tmp_path: Path, given_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = write_corpus(tmp_path / "corpus", n_files=30)
    # dozens of batches, finishing out of order
    monkeypatch.setattr(prepare_mod, "_BATCH_CHARS", 3000)
    outputs = {}
    for workers in (1, 2, 3):
        prepared = prepare_corpus(
            files,
            tmp_path / f"w{workers}",
            400,
            progress=False,
            tokenizer=given_tokenizer,
            workers=workers,
        )
        outputs[workers] = _token_bytes(prepared.data_prefix)
        assert prepared.num_docs == 30
    assert outputs[1] == outputs[2] == outputs[3]
    ds = IndexedDataset(tmp_path / "w3" / "data")
    assert given_tokenizer.decode(ds[29][:-1].tolist()) == files[29].read_text()


def test_given_tokenizer_reads_the_corpus_once(
    tmp_path: Path, given_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = write_corpus(tmp_path / "corpus")
    reads: list[Path] = []
    real = prepare_mod.iter_documents

    def counting(files_: list[Path], text_field: str = "text"):
        reads.extend(files_)
        return real(files_, text_field)

    monkeypatch.setattr(prepare_mod, "iter_documents", counting)
    monkeypatch.setattr(
        prepare_mod, "train_tokenizer", lambda *a, **k: pytest.fail("trained a tokenizer")
    )
    prepared = ensure_prepared(
        [str(tmp_path / "corpus")],
        tmp_path / "cache",
        4096,
        progress=False,
        tokenizer=given_tokenizer,
        workers=2,
    )
    # every file exactly once
    assert sorted(reads) == sorted(files + [tmp_path / "corpus" / "empty.txt"])
    assert prepared.tokenizer_path == given_tokenizer.model_path and prepared.vocab_size == 400
    meta = IndexedDataset(prepared.data_prefix).metadata
    assert meta["eos_id"] == given_tokenizer.eos_id and meta["tokenizer"] == str(
        given_tokenizer.model_path
    )


def test_compressed_and_parquet_inputs_give_the_same_tokens(
    tmp_path: Path, given_tokenizer: Tokenizer
) -> None:
    import gzip
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = [p.read_text() for p in write_corpus(tmp_path / "corpus")]
    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(lines)
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "in" / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(
        pa.table({"id": list(range(len(docs))), "text": docs}),
        tmp_path / "in" / "d.parquet",
        row_group_size=5,
    )  # 3 row groups
    assert pq.ParquetFile(tmp_path / "in" / "d.parquet").num_row_groups == 3
    (tmp_path / "in" / "e.txt.gz").write_bytes(gzip.compress(docs[0].encode()))
    (tmp_path / "in" / "f.txt.zst").write_bytes(
        zstandard.ZstdCompressor().compress(docs[1].encode())
    )
    names = ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"]
    for name in names:
        assert list(iter_documents([tmp_path / "in" / name])) == docs, name
    assert (
        list(iter_documents([tmp_path / "in" / "e.txt.gz", tmp_path / "in" / "f.txt.zst"]))
        == docs[:2]
    )
    prepared = [
        prepare_corpus(
            [tmp_path / "in" / name],
            tmp_path / name,
            400,
            progress=False,
            tokenizer=given_tokenizer,
            workers=2,
        )
        for name in names
    ]
    assert len({Path(f"{p.data_prefix}.bin").read_bytes() for p in prepared}) == 1


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("x.jsonl.gz", b"not gzip at all", r"x\.jsonl\.gz is damaged"),
        ("x.parquet", b"PAR1 not parquet", r"cannot read .*x\.parquet as parquet"),
    ],
)
@pytest.mark.fault("damaged .gz or parquet input", "one line naming the file")
def test_damaged_inputs_are_one_line(tmp_path: Path, name: str, content: bytes, match: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=match) as info:
        list(iter_documents([tmp_path / name]))
    assert "\n" not in str(info.value)


def test_parquet_without_the_text_column(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"], "n": [1]}), tmp_path / "p.parquet")
    with pytest.raises(
        DataError, match=r"no 'text' column \(it has body, n\); set data.text_field"
    ):
        list(iter_documents([tmp_path / "p.parquet"]))
    with pytest.raises(DataError, match=r"column 'n' is int64, expected strings"):
        list(iter_documents([tmp_path / "p.parquet"], text_field="n"))


class _FailingTokenizer:
    """Encodes like `inner` but fails on one text: raising (an error line) or exiting (a dead worker)."""

    def __init__(self, inner: Tokenizer, how: str) -> None:
        self.inner, self.how = inner, how
        self.vocab_size, self.eos_id, self.model_path = (
            inner.vocab_size,
            inner.eos_id,
            inner.model_path,
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if any("POISON" in t for t in texts):
            if self.how == "exit":
                os._exit(3)
            raise ValueError("cannot encode POISON")
        return self.inner.encode_batch(texts, num_threads=1)


@pytest.mark.parametrize(
    ("how", "error", "match"),
    [
        ("raise", DataError, r"tokenizing failed in a worker: ValueError: cannot encode POISON"),
        ("exit", RuntimeError, r"a tokenizer worker died \(exit code 3\)"),
    ],
)
@pytest.mark.fault(
    "tokenizer worker raises or dies", "prepare stops in one line; nothing half-written"
)
def test_worker_failure_stops_cleanly(
    tmp_path: Path, given_tokenizer: Tokenizer, how: str, error: type, match: str
) -> None:
    files = write_corpus(tmp_path / "corpus")
    files[5].write_text("POISON\n")
    with pytest.raises(error, match=match):
        prepare_corpus(
            files,
            tmp_path / "out",
            400,
            progress=False,
            tokenizer=_FailingTokenizer(given_tokenizer, how),
            workers=2,
        )
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written left behind


def test_keel_prepare_workers_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from keel.launcher.cli import main

    write_corpus(tmp_path / "corpus")
    base = [
        "prepare",
        str(tmp_path / "corpus"),
        "--vocab-size",
        "400",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(base + ["--workers", "0"])
    assert exit_info.value.code == 2 and "--workers: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(base + ["--workers", "2"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "tokenizer " in out and "/data.bin" in out and "12 documents" in out


def test_the_pool_reads_no_further_ahead_than_its_window(given_tokenizer: Tokenizer) -> None:
    """Back-pressure: the reader stays within 4 x workers batches of the writer, whatever the corpus size."""
    from keel.data.tokenize_pool import tokenize_in_order

    pulled: list[int] = []

    def batches():
        for i in range(40):
            pulled.append(i)
            yield [f"document number {i} " * 20], i

    ahead = []
    for _, lengths, tag in tokenize_in_order(given_tokenizer, batches(), workers=2):
        ahead.append(len(pulled) - tag)
        assert lengths.tolist() == [len(given_tokenizer.encode(f"document number {tag} " * 20)) + 1]
    assert max(ahead) <= 4 * 2 + 1 and len(ahead) == 40 and len(pulled) == 40
