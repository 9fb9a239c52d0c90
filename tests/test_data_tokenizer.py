"""Tokenizer training, exact round trips, and the errors a user can hit."""

import pickle
import random

import pytest

from keel.data import DataError, SentencePieceTokenizer, Tokenizer, train_tokenizer


def synthetic_docs(n_docs: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
        for _ in range(300)
    ]
    docs = []
    for _ in range(n_docs):
        lines = [
            " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
            for _ in range(rng.randint(5, 30))
        ]
        docs.append("\n".join("    " * rng.randint(0, 2) + line for line in lines) + "\n")
    return docs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return train_tokenizer(synthetic_docs(), 400, tmp_path_factory.mktemp("tok") / "tokenizer")


def test_vocab_and_special_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 400
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x  # trailing  spaces  \n\n",
        "  leading and\ttabs\t\tand 12345 digits",
        "ünïcødé, 日本語のテキスト, emoji 😀🚀, RTL שלום, math ∑∫√",
        "control \x01\x7f and NUL \x00 bytes",
        "",
    ],
)
def test_round_trip_is_exact(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_random_unicode_round_trips(tokenizer: Tokenizer) -> None:
    rng = random.Random(1)
    alphabet = [chr(c) for c in range(32, 0x3000) if not 0xD800 <= c < 0xE000] + ["\n", "\t", "😀"]
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 200)))
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_encode_batch_matches_encode(tokenizer: Tokenizer) -> None:
    texts = synthetic_docs(8, seed=5)
    assert tokenizer.encode_batch(texts, num_threads=2) == [tokenizer.encode(t) for t in texts]


def test_model_written_atomically_and_pickles(tokenizer: Tokenizer) -> None:
    assert [p.name for p in tokenizer.model_path.parent.iterdir()] == ["tokenizer.model"]
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.encode("hello world") == tokenizer.encode("hello world")


def test_training_is_deterministic(tmp_path, tokenizer: Tokenizer) -> None:
    again = train_tokenizer(synthetic_docs(), 400, tmp_path / "again")
    assert again.model_path.read_bytes() == tokenizer.model_path.read_bytes()


def test_missing_model_raises(tmp_path) -> None:
    with pytest.raises(DataError, match="keel prepare"):
        SentencePieceTokenizer(tmp_path / "nope.model")


def test_vocab_too_large_for_corpus_raises(tmp_path) -> None:
    with pytest.raises(DataError, match="too large for this corpus"):
        train_tokenizer(["tiny corpus"] * 3, 4096, tmp_path / "tok")
    assert list(tmp_path.iterdir()) == []


def test_trained_tokenizer_reports_its_identity(tokenizer: Tokenizer) -> None:
    import hashlib

    record = tokenizer.record()
    assert isinstance(tokenizer, SentencePieceTokenizer) and tokenizer.pad_id is None
    assert record == {
        "path": str(tokenizer.path),
        "kind": "sentencepiece",
        "vocab_size": 400,
        "bos_id": 1,
        "eos_id": 2,
        "pad_id": None,
        "sha256": hashlib.sha256(tokenizer.path.read_bytes()).hexdigest(),
    }
