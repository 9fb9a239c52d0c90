"""Which files make up the corpus, and how they split into documents.

The default corpus is the running interpreter's standard library source: real text that is always present, so
a first run needs no download. Everything is sorted so the same spec yields the same documents in the same order.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from keel.data.errors import DataError
from keel.data.indexed import is_token_file, token_file_prefix
from keel.data.readers import file_documents

# Directories left out of the default corpus: installed third-party code, and test suites / tools whose
# bulk (data tables, generated fixtures) would dominate the text without being representative of it.
_DEFAULT_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
)


def default_corpus_files() -> list[Path]:
    """All `*.py` files of this interpreter's stdlib, minus third-party packages and test suites, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(
            f"data.corpus: the default corpus needs the Python stdlib source at {root}; set data.corpus"
        )
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if d not in _DEFAULT_EXCLUDED_DIRS and d != "__pycache__"
        ]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(files)


@dataclass(frozen=True)
class CorpusSources:
    """What a corpus spec names: text to tokenize, and token files (`.bin`/`.idx` prefixes) used in place."""

    text_files: list[Path] = field(default_factory=list)
    token_files: list[Path] = field(default_factory=list)


def resolve_sources(spec: list[str], base_dir: Path | None = None) -> CorpusSources:
    """Expand a corpus spec into sorted, de-duplicated text files and token-file prefixes (in spec order).

    Each entry is "default", a file, a directory (all non-hidden files below it), a glob (`**` recurses) or a
    token-file prefix (`/data/pile_text_document`, with or without `.bin`/`.idx`). Inside directories and globs a
    `.bin`/`.idx` pair (and its `.json` sidecar) is a token file too. Relative entries are taken against
    `base_dir` (the config file's directory) or the working directory.
    """
    if isinstance(spec, str):
        spec = [spec]
    if not spec:
        raise DataError("data.corpus: empty; list files or globs, or use [default]")
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    text: set[Path] = set()
    tokens: dict[Path, None] = {}  # ordered set
    for entry in spec:
        prefix = None if entry == "default" else _token_entry(entry, base)
        if prefix is not None:
            tokens[prefix] = None
            continue
        matches = default_corpus_files() if entry == "default" else _expand(entry, base)
        found_text, found_tokens = _split_token_files(matches)
        if not found_text and not found_tokens:
            raise DataError(f"data.corpus: no files match {entry!r}")
        text.update(found_text)
        tokens.update(dict.fromkeys(found_tokens))
    return CorpusSources(sorted(text), list(tokens))


def resolve_corpus(spec: list[str], base_dir: Path | None = None) -> list[Path]:
    """The text files of a corpus spec, sorted (token files are left out: they need no tokenizing)."""
    return resolve_sources(spec, base_dir).text_files


def _token_entry(entry: str, base: Path) -> Path | None:
    """The token-file prefix an entry names, None for other entries; half a pair is one clear error."""
    raw = os.path.expanduser(entry)
    if any(c in raw for c in "*?["):
        return None
    path = Path(raw) if os.path.isabs(raw) else base / raw
    if path.is_dir() or (path.is_file() and path.suffix not in (".bin", ".idx")):
        return None
    prefix = token_file_prefix(path).absolute()
    have = [Path(f"{prefix}{s}").is_file() for s in (".bin", ".idx")]
    if all(have):
        return prefix
    if any(have) or path.suffix in (".bin", ".idx"):
        missing = f"{prefix}.idx" if have[0] else f"{prefix}.bin"
        raise DataError(
            f"data.corpus: {entry!r} names a token file but {missing} is missing; "
            "a token file needs both its .bin and .idx"
        )
    return None


def _split_token_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """Separate `.bin`/`.idx` pairs (and their sidecars) from text files; half a pair is an error, not text."""
    text, prefixes = [], set()
    for file in files:
        if file.suffix in (".bin", ".idx"):
            prefix = token_file_prefix(file)
            if not is_token_file(prefix):
                other = ".idx" if file.suffix == ".bin" else ".bin"
                raise DataError(
                    f"data.corpus: {file} has no {prefix}{other} beside it; a token file needs both "
                    "its .bin and .idx (or move the file out of the corpus)"
                )
            prefixes.add(prefix)
        elif not (file.suffix == ".json" and is_token_file(file.with_suffix(""))):
            text.append(file)
    return text, sorted(prefixes)


def _expand(entry: str, base: Path) -> list[Path]:
    raw = os.path.expanduser(entry)
    if any(c in raw for c in "*?["):  # a glob pattern
        pattern = raw if os.path.isabs(raw) else os.path.join(glob.escape(str(base)), raw)
        return [Path(p).absolute() for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
    path = Path(raw) if os.path.isabs(raw) else base / raw
    if path.is_dir():
        return [p.absolute() for p in _walk_files(path)]
    return [path.absolute()] if path.is_file() else []


def _walk_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        yield from (Path(dirpath, name) for name in filenames if not name.startswith("."))


def iter_documents(files: Iterable[Path], text_field: str = "text") -> Iterator[str]:
    """Yield non-empty documents: one per line of a JSON-lines file or row of a parquet file, otherwise one per
    file (keel/data/readers.py; `.gz` and `.zst` are decompressed on the fly)."""
    for file in files:
        yield from file_documents(Path(file), text_field)
