"""A SentencePiece BPE tokenizer trained on the corpus itself.

Byte fallback plus identity normalization means every string round-trips exactly (code indentation included),
so the model never sees <unk> and decoded samples are faithful to what was trained on.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from keel.data.atomic import write_atomic
from keel.data.errors import DataError

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# Training sees at most this many chunks of ~_CHUNK_CHARS each, reservoir-sampled: enough to learn merges for a
# small vocabulary while keeping training to seconds however large the corpus is.
_MAX_SENTENCES = 200_000
_CHUNK_CHARS = 1000
_MAX_SENTENCE_BYTES = 16_384  # a longer single line is left out of training (it still gets encoded later)


def train_tokenizer(documents: Iterable[str], vocab_size: int, model_prefix: Path) -> Tokenizer:
    """Train a BPE model on `documents` and write `<model_prefix>.model` atomically."""
    model_path = Path(f"{model_prefix}.model")
    model_path.parent.mkdir(parents=True, exist_ok=True)
    proto = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_chunks(documents),
            model_writer=proto,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            split_digits=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            character_coverage=0.9999,
            max_sentence_length=_MAX_SENTENCE_BYTES,
            input_sentence_size=_MAX_SENTENCES,
            shuffle_input_sentence=True,
            num_threads=min(2, os.cpu_count() or 1),
            pad_id=-1,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            minloglevel=2,
        )
    except RuntimeError as exc:
        raise DataError(_explain_training_error(str(exc), vocab_size)) from None
    write_atomic(model_path, proto.getvalue())
    return Tokenizer(model_path)


def _chunks(documents: Iterable[str]) -> Iterator[str]:
    """Cut documents into runs of whole lines so newlines and indentation are learned as pieces too."""
    for doc in documents:
        buf: list[str] = []
        size = 0
        for line in doc.splitlines(keepends=True):
            buf.append(line)
            size += len(line)
            if size >= _CHUNK_CHARS:
                yield "".join(buf)
                buf, size = [], 0
        if buf:
            yield "".join(buf)


def _explain_training_error(message: str, vocab_size: int) -> str:
    too_high = re.search(r"Vocabulary size too high.*?<= (\d+)", message)
    if too_high:
        return (
            f"data.tokenizer_vocab_size={vocab_size} is too large for this corpus (at most {too_high.group(1)}); "
            "lower it or add text"
        )
    too_low = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
    if too_low:
        return f"data.tokenizer_vocab_size={vocab_size} is too small for this corpus; use at least {too_low.group(1)}"
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return f"tokenizer training failed ({first}); check data.corpus and data.tokenizer_vocab_size"


class Tokenizer:
    """Thin wrapper over a SentencePiece model file; ids are plain ints, no BOS/EOS added implicitly."""

    def __init__(self, model_path: str | Path) -> None:
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise DataError(f"tokenizer {self.model_path} is missing; re-run `keel prepare`")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.model_path))
        except (RuntimeError, OSError):
            raise DataError(f"tokenizer {self.model_path} is not a valid model; re-run `keel prepare`") from None

    def __reduce__(self) -> tuple[type, tuple[Path]]:
        # Reload from disk in worker processes instead of pickling the native processor.
        return (Tokenizer, (self.model_path,))

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """Encode many texts on `num_threads` native threads (default: all cores)."""
        return self._sp.encode(list(texts), num_threads=num_threads or os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])
