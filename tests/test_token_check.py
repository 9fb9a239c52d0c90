"""The token-file checks (keel/data/token_check.py): each kind of corrupt index and out-of-vocabulary id is one
line naming the file, the sequence or document, and the offset; the id sample and the at-sample batch check."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import keel.data.token_check as token_check
from keel.data import DataError, IndexedDataset, IndexedDatasetWriter
from keel.data.bad_ids import locate
from keel.data.megatron_index import CODE_OF_DTYPE, HEADER, MAGIC
from keel.data.token_check import (
    check_index,
    check_token_file,
    first_bad_row,
    sample_spans,
    stand_in,
)


def write_raw(
    prefix: Path,
    lengths: list[int],
    documents: list[int],
    tokens: np.ndarray,
    pointers: list[int] | None = None,
    code: int | None = None,
) -> Path:
    """An .idx/.bin pair written byte by byte, so every field can be wrong on purpose (no sidecar)."""
    itemsize = tokens.dtype.itemsize
    if pointers is None:
        pointers = (
            np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * itemsize
            if lengths
            else []
        )
    code = CODE_OF_DTYPE[tokens.dtype] if code is None else code
    with open(f"{prefix}.idx", "wb") as out:
        out.write(HEADER.pack(MAGIC, 1, code, len(lengths), len(documents)))
        out.write(np.asarray(lengths, dtype="<i4").tobytes())
        out.write(np.asarray(pointers, dtype="<i8").tobytes())
        out.write(np.asarray(documents, dtype="<i8").tobytes())
    tokens.tofile(f"{prefix}.bin")
    return prefix


# Megatron's sentence-split layout: 3 documents over 5 sequences (lengths 2,3 | 1 | 1,1), 8 int32 tokens.
LENGTHS, DOCUMENTS = [2, 3, 1, 1, 1], [0, 2, 3, 5]
TOKENS = np.arange(1, 9, dtype=np.int32)
POINTERS = [0, 8, 20, 24, 28]


def test_a_sound_file_passes_and_locates(tmp_path: Path) -> None:
    prefix = write_raw(tmp_path / "ok", LENGTHS, DOCUMENTS, TOKENS)
    dataset = check_token_file(prefix, vocab_size=9)
    assert [locate(dataset, t) for t in range(8)] == [
        (0, 0),
        (0, 0),
        (1, 0),
        (1, 0),
        (1, 0),
        (2, 1),
        (3, 2),
        (4, 2),
    ]
    # empty sequences and an empty document are legal: a token belongs to the sequence and document holding it
    prefix = write_raw(
        tmp_path / "empty", [0, 2, 0, 1], [0, 1, 1, 4], np.arange(1, 4, dtype=np.int32)
    )
    dataset = check_token_file(prefix, vocab_size=4)
    assert [locate(dataset, t) for t in range(3)] == [(1, 2), (1, 2), (3, 2)]


CORRUPTIONS = {  # name: (lengths, documents, pointers, tokens, code, what the one line must say)
    "negative length": (
        [2, -3, 1, 1, 1],
        DOCUMENTS,
        POINTERS,
        TOKENS,
        None,
        r"ok\.idx: sequence 1 has length -3 \(byte 38\), a negative length",
    ),
    "pointer off the running sum": (
        LENGTHS,
        DOCUMENTS,
        [0, 8, 24, 24, 28],
        TOKENS,
        None,
        r"ok\.idx: sequence 2 starts at \.bin byte 24 \(index byte 70\), but the lengths "
        r"before it put it at byte 20",
    ),
    "truncated .bin": (
        LENGTHS,
        DOCUMENTS,
        POINTERS,
        TOKENS[:-1],
        None,
        r"ok\.bin: .*holds 28 bytes, its index expects 32 for its 5 sequences: the \.bin is truncated "
        r"from token 7, byte 28",
    ),
    "longer .bin": (
        LENGTHS,
        DOCUMENTS,
        POINTERS,
        np.arange(1, 10, dtype=np.int32),
        None,
        r"ok\.bin: .*holds 36 bytes, its index expects 32 .* longer than its index says from token 8",
    ),
    "documents decrease": (
        LENGTHS,
        [0, 3, 2, 5],
        POINTERS,
        TOKENS,
        None,
        r"ok\.idx: document 2 starts at sequence 2 \(byte 110\), before document 1's start at "
        r"sequence 3",
    ),
    "document beyond the sequences": (
        LENGTHS,
        [0, 2, 7, 5],
        POINTERS,
        TOKENS,
        None,
        r"ok\.idx: document 2 starts at sequence 7 \(byte 110\), beyond the 5 sequences",
    ),
    "first document not at 0": (
        LENGTHS,
        [1, 2, 3, 5],
        POINTERS,
        TOKENS,
        None,
        r"ok\.idx: document 0 starts at sequence 1 \(byte 94\), the first must be 0",
    ),
    "documents end early": (
        LENGTHS,
        [0, 2, 3, 4],
        POINTERS,
        TOKENS,
        None,
        r"ok\.idx: the document index ends at sequence 4 \(byte 118\), not at the 5 sequences",
    ),
    "unknown dtype code": (
        LENGTHS,
        DOCUMENTS,
        POINTERS,
        TOKENS,
        9,
        r"ok\.idx: .*unknown token dtype code 9 at byte 17",
    ),
    "float dtype": (
        LENGTHS,
        DOCUMENTS,
        POINTERS,
        TOKENS,
        7,
        r"ok\.idx: holds float32 values, not token ids "
        r"\(dtype code 7 at byte 17\)",
    ),
    "id outside the vocabulary": (
        LENGTHS,
        DOCUMENTS,
        POINTERS,
        np.array([1, 2, 3, 4, 5, 9, 7, 8], np.int32),
        None,
        r"ok\.bin: token 5 is id 9, outside the tokenizer's vocabulary \[0, 9\) \(byte 20, "
        r"sequence 2, document 1\); use the tokenizer that made this file",
    ),
    "negative id": (
        LENGTHS,
        DOCUMENTS,
        POINTERS,
        np.array([1, 2, 3, 4, 5, 6, 7, -1], np.int32),
        None,
        r"ok\.bin: token 7 is id -1, outside .* \(byte 28, sequence 4, document 2\)",
    ),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_each_corruption_is_one_line(tmp_path: Path, kind: str) -> None:
    lengths, documents, pointers, tokens, code, match = CORRUPTIONS[kind]
    prefix = write_raw(tmp_path / "ok", lengths, documents, tokens, pointers, code)
    with pytest.raises(DataError, match=match) as info:
        check_token_file(prefix, vocab_size=9)
    assert "\n" not in str(info.value) and str(prefix) in str(info.value)


def test_large_index_streams_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pointer error past the first chunk is found at its sequence (the running sum carries across chunks)."""
    monkeypatch.setattr(token_check.layout, "CHUNK", 7)
    lengths = [3] * 40
    pointers = list(np.arange(40, dtype=np.int64) * 6)
    tokens = np.ones(120, dtype=np.uint16)
    check_index(write_raw(tmp_path / "ok", lengths, list(range(41)), tokens))
    pointers[23] += 2
    with pytest.raises(
        DataError, match=r"sequence 23 starts at \.bin byte 140 .* put it at byte 138"
    ):
        check_index(write_raw(tmp_path / "ok", lengths, list(range(41)), tokens, pointers))
    documents = list(range(41))
    documents[30] = 20
    with pytest.raises(
        DataError,
        match=r"document 30 starts at sequence 20 .*before document 29's start at sequence "
        r"29",
    ):
        check_index(write_raw(tmp_path / "ok", lengths, documents, tokens))


def test_the_id_sample_is_bounded_and_spread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sample_spans(100, 2, chunks=4, total_bytes=400) == [
        (0, 50),
        (50, 100),
    ]  # small: all of it
    spans = sample_spans(10**9, 2)
    assert len(spans) == 64 and sum(e - s for s, e in spans) * 2 == 4 << 20
    assert spans[0][0] == 0 and spans[-1][1] == 10**9  # both ends, evenly between
    monkeypatch.setattr(token_check, "SAMPLE_BYTES", 4 * 2 * 8)  # 4 spans of 8 uint16 ids
    monkeypatch.setattr(token_check, "SAMPLE_CHUNKS", 4)
    with IndexedDatasetWriter(tmp_path / "d", 1000) as writer:
        writer.add_document(np.arange(400) % 1000)
    spans = sample_spans(400, 2, 4, 64)
    outside = next(t for t in range(400) if not any(s <= t < e for s, e in spans))
    tokens = np.fromfile(tmp_path / "d.bin", dtype=np.uint16)
    tokens[outside] = 1000
    tokens.tofile(tmp_path / "d.bin")
    # the sample does not read it: left to the at-sample check
    check_token_file(tmp_path / "d", 1000)
    tokens[outside], tokens[spans[2][0] + 3] = 5, 1000
    tokens.tofile(tmp_path / "d.bin")
    with pytest.raises(DataError, match=rf"d\.bin: token {spans[2][0] + 3} is id 1000"):
        check_token_file(tmp_path / "d", 1000)


def test_at_sample_batch_check() -> None:
    clean = [torch.randint(0, 50, (2, 9)) for _ in range(3)]
    assert first_bad_row(clean, 50) is None
    bad = [b.clone() for b in clean]
    bad[1][1, 4], bad[2][0, 0] = 50, -2
    assert first_bad_row(bad, 50) == 3  # rows count across micro-batches: micro-batch 1, row 1
    fixed = stand_in(bad, 50)
    assert first_bad_row(fixed, 50) is None and int(fixed[1][1, 4]) == 0
    assert torch.equal(fixed[0], clean[0])


@pytest.mark.fault(
    "Megatron token file with an id outside the vocabulary (in the sampled spans)",
    "one line naming file, token, byte, sequence, document; exit 2 before any rank starts",
)
def test_keel_train_refuses_a_corrupt_token_file_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from keel.data.tokenizer import train_tokenizer
    from keel.launcher.cli import main as keel_main
    from tests.test_data_prepare import write_corpus

    files = write_corpus(tmp_path / "corpus", n_files=3)
    tokenizer = train_tokenizer((f.read_text() for f in files), 300, tmp_path / "tokenizer")
    tokens = np.array(tokenizer.encode(" ".join(f.read_text() for f in files)), dtype=np.int32)
    tokens[len(tokens) // 2] = 300
    n = len(tokens)
    write_raw(tmp_path / "meg", [n // 2, n - n // 2], [0, 1, 2], tokens)
    with pytest.raises(SystemExit) as exit_info:
        keel_main(
            [
                "train",
                "--nproc",
                "2",
                "--run-dir",
                str(tmp_path / "run"),
                "--set",
                f"data.corpus=[{tmp_path / 'meg'}]",
                "--set",
                f"data.cache_dir={tmp_path / 'cache'}",
                "--set",
                f"data.tokenizer={tokenizer.path}",
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert err[-1] == (
        f"keel: error: {tmp_path / 'meg'}.bin: token {n // 2} is id 300, outside the tokenizer's "
        f"vocabulary [0, 300) (byte {4 * (n // 2)}, sequence 1, document 1); use the tokenizer that "
        "made this file (data.tokenizer)"
    )
    assert not (tmp_path / "run").exists()  # nothing written, no rank started


def megatron_file_with_a_late_bad_id(
    root: Path,
    vocab: int,
    seq_len: int = 32,
    val_fraction: float = 0.01,
    global_batch: int = 8,
    micro_batch: int = 2,
    dp: int = 2,
    step: int = 2,
    rank: int = 1,
) -> tuple[Path, int, int]:
    """A Megatron-Core-built int32 token file larger than the pre-launch id sample, whose one bad id (== vocab) sits
    in a train sample that data-parallel rank `rank` reads at `step`, outside the sampled spans. Returns the prefix,
    the bad token's index and its global sample index."""
    import warnings

    from keel.config import RunConfig
    from keel.data.samples import GlobalSampleOrder, step_sample_indices, val_boundary

    # "Transformer Engine and Apex are not installed": irrelevant to its data code
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    # 6 MB: larger than the 4 MiB id sample
    tokens = rng.integers(0, vocab, 1_500_000).astype(np.int32)
    builder = IndexedDatasetBuilder(f"{root / 'late'}.bin", dtype=np.int32)
    for first in range(0, len(tokens), 1500):
        builder.add_item(torch.from_numpy(tokens[first : first + 1500]))
        builder.end_document()
    builder.finalize(f"{root / 'late'}.idx")
    dataset = IndexedDataset(root / "late", vocab_size=vocab)
    train_samples = (val_boundary(dataset, seq_len, val_fraction) - 1) // seq_len
    order = GlobalSampleOrder(train_samples, RunConfig().train.seed)
    spans = sample_spans(dataset.num_tokens, 4)
    for sample in step_sample_indices(
        (step - 1) * global_batch, global_batch, micro_batch, rank, dp
    ):
        begin = order.sample_id(sample) * seq_len
        token = next(
            (t for t in range(begin + 1, begin + seq_len) if not any(s <= t < e for s, e in spans)),
            None,
        )
        if token is not None:
            break
    assert token is not None, "every candidate token is sampled: change the seed"
    bins = np.memmap(f"{root / 'late'}.bin", dtype=np.int32, mode="r+")
    bins[token] = vocab
    bins.flush()
    return root / "late", token, sample


@pytest.mark.slow
@pytest.mark.fault(
    "an id outside the vocabulary in a later sequence the pre-launch sample does not read (2 ranks)",
    "the rank holding it runs the step on stand-in ids; every rank stops at that step, exit 2, "
    "same line",
)
def test_a_bad_id_at_the_sample_stops_every_rank_with_one_line(tmp_path: Path) -> None:
    from keel.data.tokenizer import train_tokenizer
    from keel.run_dir import read_anomalies
    from keel.training.observe.metrics import read_metrics
    from tests.keel_runs import keel_train, tiny_overrides
    from tests.test_data_prepare import write_corpus

    files = write_corpus(tmp_path / "corpus", n_files=3)
    tokenizer = train_tokenizer((f.read_text() for f in files), 300, tmp_path / "tokenizer")
    prefix, token, sample = megatron_file_with_a_late_bad_id(tmp_path, 300, step=2, rank=1)
    # the pre-launch check passes: the sample does not read the bad id
    check_token_file(prefix, 300)
    run = tmp_path / "run"
    proc = keel_train(
        run,
        2,
        tiny_overrides(
            [str(prefix)],
            tmp_path / "cache",
            data__tokenizer=tokenizer.path,
            train__steps=4,
            logging__log_interval=1,
        ),
        expect_code=2,
    )
    lines = {
        rank: [
            ln
            for ln in proc.stdout.splitlines()
            if ln.startswith(f"[keel r{rank}] stopping at step ")
        ]
        for rank in (0, 1)
    }
    assert len(lines[0]) == len(lines[1]) == 1, proc.stdout[-3000:]
    said = lines[1][0].removeprefix("[keel r1] stopping at step 2: ")
    # the rank that never held it says the same
    assert lines[0][0] == f"[keel r0] stopping at step 2: {said}"
    assert said.startswith(
        f"{prefix}.bin: token {token} is id 300, outside the tokenizer's vocabulary [0, 300) "
        f"(byte {4 * token}, sequence {token // 1500}, document {token // 1500}, train sample "
    )
    assert f"(global sample {sample}), step 2)" in said
    # the launcher names the first rank to leave (torch's agent stops the other at once); each rank's own
    # stop line is above
    assert "Traceback" not in proc.stdout + proc.stderr
    assert re.search(r"training failed \(rank [01] exit 2\)", proc.stderr), proc.stderr[-2000:]
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and records[-1][
        "skipped"
    ]  # the stopped step's update vetoed
    assert [e["reason"] for e in read_anomalies(run) if e["kind"] == "bad_token_id"] == [said]


def test_keel_prepare_check_all_ids_reads_what_the_sample_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from keel.data.tokenizer import train_tokenizer
    from keel.launcher.cli import main as keel_main
    from tests.test_data_prepare import write_corpus

    files = write_corpus(tmp_path / "corpus", n_files=3)
    tokenizer = train_tokenizer((f.read_text() for f in files), 300, tmp_path / "tokenizer")
    tokens = np.arange(4000, dtype=np.int32) % 300
    monkeypatch.setattr(token_check, "SAMPLE_BYTES", 4 * 4 * 16)  # 4 spans of 16 int32 ids
    monkeypatch.setattr(token_check, "SAMPLE_CHUNKS", 4)
    tokens[2000] = 300  # between the sampled spans
    write_raw(tmp_path / "meg", [1000, 3000], [0, 1, 2], tokens)
    args = [
        "prepare",
        str(tmp_path / "meg"),
        "--tokenizer",
        str(tokenizer.path),
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    with pytest.raises(SystemExit) as exit_info:
        keel_main(args)
    assert exit_info.value.code == 0
    with pytest.raises(SystemExit) as exit_info:
        keel_main([*args, "--check-all-ids"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"keel: error: {tmp_path / 'meg'}.bin: token 2000 is id 300, outside the tokenizer's vocabulary [0, 300) "
        "(byte 8000, sequence 1, document 1); use the tokenizer that made this file (data.tokenizer)"
    )


@pytest.mark.fault(
    "an id outside the vocabulary in a validation window the id sample does not read",
    "one line naming the validation sample; exit 2 before any rank starts",
)
def test_the_evaluation_windows_are_checked_in_full_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from keel.data.samples import val_boundary
    from keel.data.tokenizer import train_tokenizer
    from keel.launcher.cli import main as keel_main
    from tests.keel_runs import tiny_overrides
    from tests.test_data_prepare import write_corpus

    files = write_corpus(tmp_path / "corpus", n_files=3)
    tokenizer = train_tokenizer((f.read_text() for f in files), 300, tmp_path / "tokenizer")
    monkeypatch.setattr(token_check, "SAMPLE_BYTES", 4 * 4 * 16)  # 4 spans of 16 int32 ids
    monkeypatch.setattr(token_check, "SAMPLE_CHUNKS", 4)
    tokens = np.arange(8000, dtype=np.int32) % 300
    write_raw(tmp_path / "meg", [4000, 4000], [0, 1, 2], tokens)
    start = val_boundary(IndexedDataset(tmp_path / "meg", vocab_size=300), 32, 0.1)
    tokens[start + 40] = 300  # validation window 1
    assert not any(s <= start + 40 < e for s, e in sample_spans(8000, 4, 4, 256))
    write_raw(tmp_path / "meg", [4000, 4000], [0, 1, 2], tokens)
    args = ["train", "--nproc", "2", "--run-dir", str(tmp_path / "run")]
    for item in tiny_overrides(
        [str(tmp_path / "meg")],
        tmp_path / "cache",
        data__tokenizer=tokenizer.path,
        data__val_fraction=0.1,
        train__eval_interval=5,
    ):
        args += ["--set", item]
    with pytest.raises(SystemExit) as exit_info:
        keel_main(args)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"keel: error: {tmp_path / 'meg'}.bin: token {start + 40} is id 300, outside the tokenizer's vocabulary "
        f"[0, 300) (byte {4 * (start + 40)}, sequence 1, document 1, validation sample 1); every evaluation reads "
        "it; fix or regenerate the file (or set train.eval_interval=0)"
    )
    assert not (tmp_path / "run").exists()
