"""Which tokenizer a run uses (`data.tokenizer: train | PATH`): where PATH points, what it is, and its identity.

Resolving and hashing the source reads only the tokenizer's own files, so the cache lookup (whose key includes the
hash) is cheap and never loads transformers; a mistake in PATH is one line naming what to give instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from keel.data.errors import DataError
from keel.data.hf_tokenizer import HFTokenizer, hf_tokenizer_files
from keel.data.tokenizer import SentencePieceTokenizer, Tokenizer, files_sha256, train_tokenizer

TRAIN = "train"
_WHAT_TO_GIVE = (
    "give a sentencepiece .model, a Hugging Face tokenizer.json or tokenizer directory, or 'train'"
)


def resolve_tokenizer_path(value: str, base_dir: Path | None = None) -> Path | None:
    """None for `train`, else the absolute path `value` names (relative to `base_dir`, the config's directory, or
    the working directory), which must exist."""
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"data.tokenizer: empty; {_WHAT_TO_GIVE}")
    if value == TRAIN:
        return None
    path = Path(os.path.expanduser(value))
    if not path.is_absolute():
        path = (Path(base_dir) if base_dir is not None else Path.cwd()) / path
    if not path.exists():
        raise DataError(f"data.tokenizer: {path} does not exist; {_WHAT_TO_GIVE}")
    return path.absolute()


def expected_vocab_size(value: str, trained_size: int, base_dir: Path | None = None) -> int:
    """The vocabulary a run's tokenizer will have, known before any data is prepared: the given tokenizer's
    size, or `trained_size` (data.tokenizer_vocab_size) for one still to train."""
    path = resolve_tokenizer_path(value, base_dir)
    return load_tokenizer(path).vocab_size if path else trained_size


def _is_sentencepiece(path: Path) -> bool:
    """A file that is not JSON is taken for a sentencepiece model (their names vary: tokenizer.model, spm.model)."""
    return path.is_file() and path.suffix.lower() != ".json"


def source_files(path: Path) -> list[Path]:
    """The files that define the tokenizer at `path` (a directory holding only tokenizer.model is sentencepiece)."""
    if path.is_file():
        return [path]
    return hf_tokenizer_files(path)


def source_sha256(path: Path) -> str:
    """The hash of the tokenizer's files, without loading it (for the cache key)."""
    try:
        return files_sha256(path, source_files(path))
    except OSError as exc:
        raise DataError(f"data.tokenizer: cannot read {path} ({exc.strerror or exc})") from None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A sentencepiece model file, a tokenizer.json, or an HF tokenizer/model directory, behind one interface."""
    path = Path(path)
    if _is_sentencepiece(path):
        return SentencePieceTokenizer(path)
    if path.is_dir() and [p.name for p in hf_tokenizer_files(path)] == ["tokenizer.model"]:
        # e.g. an original Llama checkpoint's directory
        return SentencePieceTokenizer(path / "tokenizer.model")
    if path.exists() or path.suffix.lower() == ".json":
        return HFTokenizer(path)
    raise DataError(f"tokenizer {path} is missing; re-run `keel prepare`")


def load_or_train_tokenizer(
    source: Path | None,
    documents: Iterable[str],
    vocab_size: int,
    out_dir: Path,
    name: str = "tokenizer",
) -> Tokenizer:
    """The given tokenizer, copied into `out_dir` (so a cache entry holds the tokenizer its tokens were made
    with), or one trained on `documents` as `out_dir/<name>.model`. Returns the copy's or the trained one's."""
    if source is None:
        return train_tokenizer(documents, vocab_size, out_dir / name)
    given = load_tokenizer(source)
    if isinstance(given, SentencePieceTokenizer):
        copy = out_dir / f"{name}.model"
        shutil.copyfile(given.path, copy)
        return SentencePieceTokenizer(copy)
    assert isinstance(given, HFTokenizer)
    return HFTokenizer(given.save_copy(out_dir / name))
