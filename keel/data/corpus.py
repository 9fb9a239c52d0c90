"""Which files make up the corpus, and how they split into documents.

The default corpus is the running interpreter's standard library source: real text that is always present, so
a first run needs no download. Everything is sorted so the same spec yields the same documents in the same order.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from keel.data.errors import DataError

# Directories left out of the default corpus: installed third-party code, and test suites / tools whose
# bulk (data tables, generated fixtures) would dominate the text without being representative of it.
_DEFAULT_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})
_JSON_LINES_SUFFIXES = frozenset({".jsonl", ".ndjson", ".json"})


def default_corpus_files() -> list[Path]:
    """All `*.py` files of this interpreter's stdlib, minus third-party packages and test suites, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"data.corpus: the default corpus needs the Python stdlib source at {root}; set data.corpus")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _DEFAULT_EXCLUDED_DIRS and d != "__pycache__"]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(files)


def resolve_corpus(spec: list[str], base_dir: Path | None = None) -> list[Path]:
    """Expand a corpus spec into a sorted, de-duplicated file list.

    Each entry is "default", a file, a directory (all non-hidden files below it) or a glob (`**` recurses).
    Relative entries are taken against `base_dir` (the config file's directory) or the working directory.
    """
    if isinstance(spec, str):
        spec = [spec]
    if not spec:
        raise DataError("data.corpus: empty; list files or globs, or use [default]")
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    found: set[Path] = set()
    for entry in spec:
        matches = default_corpus_files() if entry == "default" else _expand(entry, base)
        if not matches:
            raise DataError(f"data.corpus: no files match {entry!r}")
        found.update(matches)
    return sorted(found)


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
    """Yield non-empty documents: one per line of a JSON-lines file, otherwise one per file."""
    for file in files:
        file = Path(file)
        if file.suffix.lower() in _JSON_LINES_SUFFIXES:
            yield from _iter_json_lines(file, text_field)
            continue
        try:
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise DataError(f"data.corpus: cannot read {file} ({exc.strerror or exc})") from None
        if text:
            yield text


def _iter_json_lines(file: Path, text_field: str) -> Iterator[str]:
    try:
        handle = open(file, encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"data.corpus: cannot read {file} ({exc.strerror or exc})") from None
    with handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{file}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg}); expected one JSON object per line") from None
            if not isinstance(record, dict) or text_field not in record:
                raise DataError(f"{where}: no {text_field!r} field; set data.text_field to the field holding the text")
            text = record[text_field]
            if not isinstance(text, str):
                raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, expected a string")
            if text:
                yield text
