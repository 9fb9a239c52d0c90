"""A Hugging Face tokenizer behind Keel's `Tokenizer` interface: a bare `tokenizer.json`, or a tokenizer directory.

A directory (a tokenizer's own, or a whole HF model directory) is loaded by `transformers.AutoTokenizer` with
`local_files_only=True`, never the hub: transformers is the authority on what its files mean (model-specific
classes rebuild the backend, tokenizer_config.json names the special tokens, a slow-only tokenizer is converted),
so Keel encodes exactly as the model's own tokenizer does. A bare `tokenizer.json` needs only `tokenizers`.
Either way encoding runs on the Rust backend (`tokenizers.Tokenizer`), with truncation and padding switched off:
a document is encoded whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer

from keel.data.errors import DataError
from keel.data.tokenizer import Tokenizer

TOKENIZER_JSON = "tokenizer.json"
# The files a Hugging Face tokenizer directory may define its tokenizer with (fast, slow sentencepiece / BPE /
# WordPiece, and the configs naming the special tokens); a model directory's weights and config.json are not
# among them, so neither the hash nor the cache copy ever reads gigabytes of weights.
HF_TOKENIZER_FILES = (
    TOKENIZER_JSON,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tiktoken.model",
)
# A bare tokenizer.json does not say which token plays which role (tokenizer_config.json does), so its special
# tokens are found by the conventional names; the first one present wins.
_CONVENTIONAL_NAMES = {
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
    "eos": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"),
    "pad": ("<pad>", "<|pad|>", "[PAD]"),
}


def hf_tokenizer_files(directory: Path) -> list[Path]:
    """The tokenizer files present in an HF directory; none is one clear line (a model dir without a tokenizer)."""
    files = [directory / name for name in HF_TOKENIZER_FILES if (directory / name).is_file()]
    if not files:
        raise DataError(
            f"data.tokenizer: directory {directory} holds no tokenizer files (expected one of "
            f"{', '.join(HF_TOKENIZER_FILES[:5])}, ...); point it at a tokenizer or model directory that "
            "has them, or use data.tokenizer=train"
        )
    return files


class HFTokenizer(Tokenizer):
    """`tokenizer.json` (via `tokenizers`) or an HF directory (via `AutoTokenizer`, offline)."""

    kind = "hf"

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        if self.path.is_dir():
            self._auto = _load_directory(self.path)
            backend = self._auto.backend_tokenizer
            named = {
                role: getattr(self._auto, f"{role}_token", None) for role in _CONVENTIONAL_NAMES
            }
            conventional = False  # transformers read the configs: a role they leave unset is unset
        elif self.path.is_file():
            self._auto = None
            backend = _load_json(self.path)
            named, conventional = {}, True
        else:
            raise DataError(f"tokenizer {self.path} is missing; re-run `keel prepare`")
        backend.no_truncation()  # a tokenizer.json may carry a max length: documents must be encoded whole
        backend.no_padding()
        self._backend = backend
        vocab = backend.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        self._ids = {
            role: _special_id(role, named.get(role), vocab, conventional)
            for role in _CONVENTIONAL_NAMES
        }
        self._require_eos()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self._ids["eos"]

    @property
    def pad_id(self) -> int | None:
        return self._ids["pad"]

    def files(self) -> list[Path]:
        return hf_tokenizer_files(self.path) if self.path.is_dir() else [self.path]

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """Encode many texts; num_threads=1 stays on this thread, otherwise the Rust pool of `tokenizers` runs them
        (it sizes itself once per process: RAYON_NUM_THREADS, or TOKENIZERS_PARALLELISM=false to turn it off)."""
        if num_threads == 1:
            return [self.encode(text) for text in texts]
        return [
            enc.ids
            for enc in self._backend.encode_batch_fast(list(texts), add_special_tokens=False)
        ]

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save_copy(self, dest: Path) -> Path:
        """Write this tokenizer to `dest` as a loadable copy (for the prepared cache entry); returns its path.

        A directory is saved by transformers itself (`save_pretrained`: tokenizer.json plus the configs naming the
        special tokens), a bare tokenizer.json is copied byte for byte.
        """
        if self._auto is None:
            target = dest.with_suffix(".json")
            target.write_bytes(self.path.read_bytes())
            return target
        self._auto.save_pretrained(str(dest))
        return dest


def _load_json(path: Path):
    try:
        return RustTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for unparsable files
        first = (str(exc).strip().splitlines() or ["unreadable"])[0]
        raise DataError(
            f"data.tokenizer: {path} is not a Hugging Face tokenizer.json ({first}); give a "
            "tokenizer.json, an HF tokenizer directory or a sentencepiece .model"
        ) from None


def _load_directory(path: Path):
    # a directory without tokenizer files gets its own line, not transformers' message
    hf_tokenizer_files(path)
    # slow to import (seconds): only for a tokenizer directory
    from transformers import (
        AutoTokenizer,
    )

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    # transformers raises ValueError, OSError, KeyError, ... for files it cannot read
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(
            f"data.tokenizer: transformers cannot load the tokenizer in {path} ({first}); "
            "check its tokenizer files"
        ) from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise DataError(
            f"data.tokenizer: {path} loads as {type(tokenizer).__name__}, which has no `tokenizers` "
            "backend; add a tokenizer.json (save it with a fast tokenizer's save_pretrained)"
        )
    return tokenizer


def _special_id(role: str, token: object, vocab: dict[str, int], conventional: bool) -> int | None:
    """The id of the token named for `role` (a string or an AddedToken; transformers adds a named token missing from
    the vocabulary, so it is there), else (a bare tokenizer.json) the first conventional name present."""
    if token is not None:
        return vocab.get(str(getattr(token, "content", token)))
    if not conventional:
        return None
    return next((vocab[name] for name in _CONVENTIONAL_NAMES[role] if name in vocab), None)
