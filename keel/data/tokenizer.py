"""The tokenizer interface every part of Keel uses, its SentencePiece implementation, and training one.

A trained tokenizer is SentencePiece BPE with byte fallback plus identity normalization, so every string
round-trips exactly (code indentation included), the model never sees <unk> and decoded samples are faithful to
what was trained on. A tokenizer the user brings (`data.tokenizer: PATH`) is a SentencePiece model or a Hugging
Face one (keel/data/hf_tokenizer.py); both answer the same questions, so preparation and training never ask which.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import sentencepiece as spm

from keel.data.errors import DataError
from keel.run_dir import write_atomic

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# Training sees at most this many chunks of ~_CHUNK_CHARS each, reservoir-sampled: enough to learn merges for a
# small vocabulary while keeping training to seconds however large the corpus is.
_MAX_SENTENCES = 200_000
_CHUNK_CHARS = 1000
# a longer single line is left out of training (it still gets encoded later)
_MAX_SENTENCE_BYTES = 16_384
_HASH_BLOCK = 1 << 20


class Tokenizer(ABC):
    """Text ↔ ids, plus the facts a run records: vocabulary size, special ids, and the files it was loaded from.

    `encode` never adds BOS/EOS: preparation appends EOS after each document itself. Pickling reloads from `path`,
    so worker processes get their own native tokenizer instead of a serialized one.
    """

    kind: str  # "sentencepiece" | "hf", recorded in the run dir

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __reduce__(self) -> tuple[type, tuple[Path]]:
        return (type(self), (self.path,))

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """One past the largest id this tokenizer emits (what model.vocab_size must cover)."""

    @property
    @abstractmethod
    def bos_id(self) -> int | None: ...

    @property
    @abstractmethod
    def eos_id(self) -> int: ...

    @property
    @abstractmethod
    def pad_id(self) -> int | None: ...

    @abstractmethod
    def files(self) -> list[Path]:
        """The files that define this tokenizer (what its sha256 covers)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def encode_batch(
        self, texts: Sequence[str], num_threads: int | None = None
    ) -> list[list[int]]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    def name(self) -> str:
        return self.path.name

    @cached_property
    def sha256(self) -> str:
        return files_sha256(self.path, self.files())

    def record(self) -> dict[str, Any]:
        """What the run dir keeps about this tokenizer (data.json), enough to tell whether a resume changed it."""
        return {
            "path": str(self.path),
            "kind": self.kind,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
        }

    def _require_eos(self) -> None:
        if self.eos_id is None or not 0 <= self.eos_id < self.vocab_size:
            raise DataError(
                f"data.tokenizer: {self.path} defines no EOS token, and Keel separates documents with "
                "EOS; use a tokenizer that has one (for Hugging Face: eos_token in tokenizer_config.json)"
            )


def files_sha256(root: Path, files: list[Path]) -> str:
    """sha256 of a single file's bytes (what `sha256sum` prints), or for a directory of its files' (name, sha256)."""
    if files == [root]:
        return _file_sha256(root)
    pairs = sorted((file.relative_to(root).as_posix(), _file_sha256(file)) for file in files)
    return hashlib.sha256(repr(pairs).encode()).hexdigest()


def _file_sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file (trained by Keel, or brought); ids are plain ints."""

    kind = "sentencepiece"

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        if not self.path.is_file():
            raise DataError(f"tokenizer {self.path} is missing; re-run `keel prepare`")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError):
            raise DataError(
                f"tokenizer {self.path} is not a valid sentencepiece model; give a sentencepiece "
                "`.model`, a Hugging Face tokenizer.json or tokenizer directory"
            ) from None
        self._require_eos()

    @property
    def model_path(self) -> Path:
        return self.path

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int | None:
        return _optional_id(self._sp.bos_id())

    @property
    def eos_id(self) -> int | None:
        return _optional_id(self._sp.eos_id())

    @property
    def pad_id(self) -> int | None:
        return _optional_id(self._sp.pad_id())

    def files(self) -> list[Path]:
        return [self.path]

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """Encode many texts on `num_threads` native threads (default: all cores)."""
        return self._sp.encode(list(texts), num_threads=num_threads or os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def _optional_id(value: int) -> int | None:
    return None if value < 0 else value  # sentencepiece says -1 for a role it has no piece for


def train_tokenizer(
    documents: Iterable[str], vocab_size: int, model_prefix: Path
) -> SentencePieceTokenizer:
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
    return SentencePieceTokenizer(model_path)


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
