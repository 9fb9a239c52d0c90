"""Bring your own tokenizer: sentencepiece, HF tokenizer.json and HF directories load, encode like their own
libraries, prepare a corpus without training, reach the model config and the run dir, and bad input is one line."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import keel.data.tokenizer_source as source_mod
from keel.config import ConfigError
from keel.data import (
    DataError,
    HFTokenizer,
    IndexedDataset,
    SentencePieceTokenizer,
    ensure_prepared,
    iter_documents,
    load_tokenizer,
    resolve_tokenizer_path,
    source_sha256,
)
from keel.launcher.cli import main as keel_main
from keel.launcher.run_spec import build_run, prepare_data
from tests.keel_runs import keel_train, tiny_overrides
from tests.test_data_prepare import write_corpus
from tests.test_data_tokenizer import synthetic_docs

TEXTS = [
    "def f(x):\n    return x  # two  spaces\n",
    "ünïcødé and emoji 😀",
    "",
    "hello world " * 40,
]


def byte_level_bpe(specials: list[str], docs: list[str]) -> RustTokenizer:
    """A small byte-level BPE (every string encodes and round-trips) trained with the `tokenizers` library."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer)
    return tok


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tokenizer of each kind, built here: no download."""
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tokenizers")
    docs = synthetic_docs(30, seed=3)
    out = {}
    # a bare tokenizer.json: its special tokens go by their conventional names
    out["json"] = root / "tokenizer.json"
    byte_level_bpe(["<s>", "</s>", "<pad>"], docs).save(str(out["json"]))
    # a directory whose tokenizer_config.json names unconventional special tokens (and no pad)
    named = byte_level_bpe(["<|start|>", "<|stop|>"], docs)
    out["dir"] = root / "hf_dir"
    PreTrainedTokenizerFast(
        tokenizer_object=named, bos_token="<|start|>", eos_token="<|stop|>"
    ).save_pretrained(str(out["dir"]))
    out["json_no_eos"] = root / "no_eos" / "tokenizer.json"
    out["json_no_eos"].parent.mkdir()
    named.save(str(out["json_no_eos"]))
    # a sentencepiece model with its own id layout (pad 0, unk 1, eos 2, no bos), lossless so text round-trips
    out["sp"] = root / "spm.model"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs),
        model_prefix=str(root / "spm"),
        vocab_size=300,
        model_type="bpe",
        byte_fallback=True,
        pad_id=0,
        unk_id=1,
        bos_id=-1,
        eos_id=2,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        minloglevel=2,
    )
    out["sp_no_eos"] = root / "no_eos.model"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs),
        model_prefix=str(root / "no_eos"),
        vocab_size=300,
        model_type="bpe",
        byte_fallback=True,
        bos_id=-1,
        eos_id=-1,
        minloglevel=2,
    )
    return out


def test_sentencepiece_encodes_like_sentencepiece(made: dict[str, Path]) -> None:
    tok = load_tokenizer(made["sp"])
    reference = spm.SentencePieceProcessor(model_file=str(made["sp"]))
    assert isinstance(tok, SentencePieceTokenizer) and tok.kind == "sentencepiece"
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (300, None, 2, 0)
    assert [tok.encode(t) for t in TEXTS] == [reference.encode(t) for t in TEXTS]
    assert tok.encode_batch(TEXTS, num_threads=2) == [tok.encode(t) for t in TEXTS]


def test_tokenizer_json_encodes_like_tokenizers(made: dict[str, Path]) -> None:
    tok = load_tokenizer(made["json"])
    reference = RustTokenizer.from_file(str(made["json"]))
    assert isinstance(tok, HFTokenizer) and tok.kind == "hf"
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (
        reference.get_vocab_size(),
        0,
        1,
        2,
    )
    assert [tok.encode(t) for t in TEXTS] == [
        reference.encode(t, add_special_tokens=False).ids for t in TEXTS
    ]
    for threads in (1, None):
        assert tok.encode_batch(TEXTS, num_threads=threads) == [tok.encode(t) for t in TEXTS]
    assert [tok.decode(tok.encode(t)) for t in TEXTS] == TEXTS


def test_hf_directory_encodes_like_transformers(made: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = load_tokenizer(made["dir"])
    reference = AutoTokenizer.from_pretrained(str(made["dir"]), local_files_only=True)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id) == (reference.bos_token_id, reference.eos_token_id) == (0, 1)
    assert tok.pad_id is reference.pad_token_id is None
    assert tok.vocab_size == len(reference)
    assert [tok.encode(t) for t in TEXTS] == [
        reference.encode(t, add_special_tokens=False) for t in TEXTS
    ]
    assert [tok.decode(tok.encode(t)) for t in TEXTS] == TEXTS


def test_directories_of_a_sentencepiece_model(made: dict[str, Path], tmp_path: Path) -> None:
    """Only tokenizer.model (an original Llama checkpoint): sentencepiece. With a tokenizer_config.json naming a
    slow class: transformers converts it, and Keel encodes as transformers does."""
    from transformers import AutoTokenizer

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.model").write_bytes(made["sp"].read_bytes())
    tok = load_tokenizer(bare)
    assert tok.kind == "sentencepiece" and tok.encode(TEXTS[0]) == load_tokenizer(
        made["sp"]
    ).encode(TEXTS[0])
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "tokenizer.model").write_bytes(made["sp"].read_bytes())
    (slow / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "eos_token": "</s>",
                "bos_token": None,
                "pad_token": "<pad>",
            }
        )
    )
    tok = load_tokenizer(slow)
    reference = AutoTokenizer.from_pretrained(str(slow), local_files_only=True)
    assert (tok.kind, tok.bos_id, tok.eos_id, tok.pad_id) == ("hf", None, 2, 0)
    assert [tok.encode(t) for t in TEXTS] == [
        reference.encode(t, add_special_tokens=False) for t in TEXTS
    ]


@pytest.mark.parametrize("kind", ["sp", "json", "dir"])
def test_pickles_by_path(made: dict[str, Path], kind: str) -> None:
    tok = load_tokenizer(made[kind])
    blob = pickle.dumps(tok)
    assert len(blob) < 1000  # the path, not the vocabulary
    assert pickle.loads(blob).encode(TEXTS[0]) == tok.encode(TEXTS[0])


def test_sha256_covers_the_tokenizer_files_only(made: dict[str, Path], tmp_path: Path) -> None:
    assert load_tokenizer(made["sp"]).sha256 == hashlib.sha256(made["sp"].read_bytes()).hexdigest()
    assert source_sha256(made["json"]) == load_tokenizer(made["json"]).sha256
    directory = tmp_path / "model_dir"
    directory.mkdir()
    for file in made["dir"].iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    before = source_sha256(directory)
    assert before == load_tokenizer(made["dir"]).sha256
    (directory / "model.safetensors").write_bytes(b"weights are not part of the tokenizer")
    (directory / "config.json").write_text("{}")
    assert source_sha256(directory) == before
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**config, "eos_token": "<|start|>"})
    )
    assert source_sha256(directory) != before
    assert load_tokenizer(directory).eos_id == 0


def test_documents_are_never_truncated(made: dict[str, Path], tmp_path: Path) -> None:
    truncating = RustTokenizer.from_file(str(made["json"]))
    truncating.enable_truncation(max_length=8)
    path = tmp_path / "truncating.json"
    truncating.save(str(path))
    assert len(load_tokenizer(path).encode(TEXTS[3])) > 8


@pytest.mark.parametrize("kind", ["sp", "json", "dir"])
def test_prepare_with_a_given_tokenizer(
    made: dict[str, Path], kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = write_corpus(tmp_path / "corpus", n_files=6)
    source = made[kind]
    given = load_tokenizer(source)

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained a tokenizer although one was given")

    monkeypatch.setattr(source_mod, "train_tokenizer", no_training)
    prepared = ensure_prepared(
        [str(tmp_path / "corpus")], tmp_path / "cache", 4096, progress=False, tokenizer=source
    )
    copy = load_tokenizer(prepared.tokenizer_path)
    # the entry holds its tokenizer
    assert prepared.tokenizer_path.parent == prepared.data_prefix.parent
    assert (copy.kind, copy.vocab_size, copy.bos_id, copy.eos_id, copy.pad_id) == (
        given.kind,
        given.vocab_size,
        given.bos_id,
        given.eos_id,
        given.pad_id,
    )
    ds = IndexedDataset(prepared.data_prefix)
    docs = list(iter_documents(sorted(files)))
    assert len(ds) == len(docs) and ds.vocab_size == given.vocab_size
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == given.encode(doc) + [given.eos_id]
        assert given.decode(ds[i][:-1].tolist()) == doc
    # the same tokenizer finds the entry whatever data.tokenizer_vocab_size says; another tokenizer re-prepares
    again = ensure_prepared(
        [str(tmp_path / "corpus")], tmp_path / "cache", 300, progress=False, tokenizer=source
    )
    assert again == prepared
    other = made["json" if kind != "json" else "sp"]
    assert (
        ensure_prepared(
            [str(tmp_path / "corpus")], tmp_path / "cache", 4096, progress=False, tokenizer=other
        ).data_prefix.parent
        != prepared.data_prefix.parent
    )


def test_special_ids_and_vocab_reach_the_model_and_the_record(
    made: dict[str, Path], tmp_path: Path
) -> None:
    write_corpus(tmp_path / "corpus", n_files=4)
    spec = build_run(
        None,
        [
            f"data.corpus=[{tmp_path / 'corpus'}]",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"data.tokenizer={made['dir']}",
        ],
        None,
        str(tmp_path / "run"),
        1,
    )
    prepare_data(spec)
    tok = load_tokenizer(made["dir"])
    m = spec.cfg.model
    assert (m.vocab_size, m.bos_id, m.eos_id, m.pad_id) == (tok.vocab_size, 0, 1, -1)
    info = spec.data["tokenizer_info"]
    assert info == {
        **info,
        "source": str(made["dir"]),
        "kind": "hf",
        "sha256": source_sha256(made["dir"]),
        "vocab_size": tok.vocab_size,
        "bos_id": 0,
        "eos_id": 1,
        "pad_id": None,
    }


@pytest.mark.fault("resume with another tokenizer", "refused in one line before any rank")
def test_resume_with_another_tokenizer_is_refused(made: dict[str, Path], tmp_path: Path) -> None:
    from keel.launcher.run_spec import write_run_dir

    write_corpus(tmp_path / "corpus", n_files=4)
    base = [f"data.corpus=[{tmp_path / 'corpus'}]", f"data.cache_dir={tmp_path / 'cache'}"]
    run = tmp_path / "run"
    first = build_run(None, base + [f"data.tokenizer={made['json']}"], None, str(run), 1)
    prepare_data(first)
    write_run_dir(first)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("step00000010")
    same = build_run(None, base + [f"data.tokenizer={made['json']}"], None, str(run), 1)
    prepare_data(same)  # the same tokenizer resumes
    changed = build_run(None, base + [f"data.tokenizer={made['sp']}"], None, str(run), 1)
    with pytest.raises(
        ConfigError, match=r"checkpoints in .* were trained with tokenizer .*tokenizer\.json"
    ):
        prepare_data(changed)
    fresh = build_run(
        None, base + [f"data.tokenizer={made['sp']}", "checkpoint.resume=false"], None, str(run), 1
    )
    prepare_data(fresh)


def _write_bad(tmp_path: Path, made: dict[str, Path], case: str) -> str:
    if case == "missing":
        return str(tmp_path / "nope.model")
    if case == "text_file":
        (tmp_path / "notes.txt").write_text("not a tokenizer")
        return str(tmp_path / "notes.txt")
    if case == "bad_json":
        (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
        return str(tmp_path / "tokenizer.json")
    if case == "model_dir_without_tokenizer":
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        (tmp_path / "model" / "model.safetensors").write_bytes(b"")
        return str(tmp_path / "model")
    return str(made[case])


BAD_INPUTS = {
    "missing": "nope.model does not exist",
    "text_file": "notes.txt is not a valid sentencepiece model",
    "bad_json": "is not a Hugging Face tokenizer.json",
    "model_dir_without_tokenizer": "holds no tokenizer files",
    "json_no_eos": "defines no EOS token",
    "sp_no_eos": "defines no EOS token",
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.fault("missing or unusable tokenizer", "one line naming it; exit 2")
def test_bad_tokenizer_is_one_line(
    made: dict[str, Path], case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_corpus(tmp_path / "corpus", n_files=2)
    bad = _write_bad(tmp_path, made, case)
    with pytest.raises(SystemExit) as exit_info:
        keel_main(
            [
                "train",
                "--nproc",
                "1",
                "--run-dir",
                str(tmp_path / "run"),
                "--set",
                f"data.corpus=[{tmp_path / 'corpus'}]",
                "--set",
                f"data.cache_dir={tmp_path / 'cache'}",
                "--set",
                f"data.tokenizer={bad}",
            ]
        )
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert (
        len(err.splitlines()) == 1 and err.startswith("keel: error: ") and BAD_INPUTS[case] in err
    ), err
    assert not (tmp_path / "run").exists()  # refused before anything was written or launched


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.vocab_size=100", "model.vocab_size=100 is smaller than the tokenizer's"),
        ("model.eos_id=5", "model.eos_id=5 differs from the tokenizer's (1"),
    ],
)
@pytest.mark.fault(
    "model vocabulary or special ids disagree with the tokenizer", "one line naming the field"
)
def test_model_tokenizer_mismatch_is_one_line(
    made: dict[str, Path], override: str, message: str, tmp_path: Path
) -> None:
    write_corpus(tmp_path / "corpus", n_files=2)
    spec = build_run(
        None,
        [
            f"data.corpus=[{tmp_path / 'corpus'}]",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"data.tokenizer={made['json']}",
            override,
        ],
        None,
        str(tmp_path / "run"),
        1,
    )
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        prepare_data(spec)


def test_vocab_size_setting_applies_only_when_training(
    made: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="data.tokenizer_vocab_size: 100 is too small"):
        build_run(None, ["data.tokenizer_vocab_size=100"], None, str(tmp_path / "run"), 1)
    build_run(
        None,
        ["data.tokenizer_vocab_size=100", f"data.tokenizer={made['sp']}"],
        None,
        str(tmp_path / "run"),
        1,
    )
    with pytest.raises(ConfigError, match="data.tokenizer: empty"):
        build_run(None, ["data.tokenizer=''"], None, str(tmp_path / "run"), 1)


def test_relative_path_is_taken_from_the_config_directory(
    made: dict[str, Path], tmp_path: Path
) -> None:
    assert resolve_tokenizer_path("train", tmp_path) is None
    assert resolve_tokenizer_path(made["sp"].name, made["sp"].parent) == made["sp"]
    with pytest.raises(DataError, match="does not exist"):
        resolve_tokenizer_path(made["sp"].name, tmp_path)


@pytest.mark.slow
def test_keel_train_with_a_given_hf_tokenizer(made: dict[str, Path], tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus", n_files=12)
    run = tmp_path / "run"
    keel_train(
        run,
        1,
        tiny_overrides(
            [str(tmp_path / "corpus")],
            tmp_path / "cache",
            data__tokenizer=made["dir"],
            train__steps=4,
            train__warmup_steps=1,
        ),
    )
    info = json.loads((run / "data.json").read_text())["tokenizer_info"]
    tok = load_tokenizer(made["dir"])
    assert (info["source"], info["kind"], info["sha256"]) == (
        str(made["dir"]),
        "hf",
        source_sha256(made["dir"]),
    )
    assert (info["vocab_size"], info["eos_id"]) == (tok.vocab_size, 1)
    import yaml

    model = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert (model["vocab_size"], model["eos_id"]) == (tok.vocab_size, 1)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4
