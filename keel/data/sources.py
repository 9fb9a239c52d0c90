"""Reading corpus files as batches of documents: plain text, JSON lines, gzip/zstd-compressed either, parquet.

A batch ("unit") is cut by size alone, the same for any number of workers, so the order of documents, and hence
the token file, never depends on the parallelism. JSON lines travel as raw bytes and are parsed where they are
tokenized (in the worker processes), so the reading process does little more than read and decompress.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from keel.data.errors import DataError

JSON_LINES_SUFFIXES = frozenset({".jsonl", ".ndjson", ".json"})
COMPRESSED_SUFFIXES = frozenset({".gz", ".zst", ".zstd"})
PARQUET_SUFFIX = ".parquet"
UNIT_BYTES = 2 << 20  # text per batch: big enough to amortize inter-process transfer, small enough to bound memory
_PARQUET_ROWS = 4096  # rows per pyarrow record batch (row groups are read one at a time)


@dataclass(frozen=True)
class Unit:
    """A batch of documents: `texts` ready to tokenize, or raw JSON `lines` from `source` (1-based first_line)."""

    texts: tuple[str, ...] = ()
    lines: tuple[bytes, ...] = ()
    source: str = ""
    first_line: int = 1
    text_field: str = "text"

    def documents(self) -> list[str]:
        """The batch's non-empty documents, in order (JSON lines parsed here, with file:line in any error)."""
        if not self.lines:
            return [t for t in self.texts if t]
        out = []
        for offset, raw in enumerate(self.lines):
            if raw.strip():
                text = _json_text(raw, f"{self.source}:{self.first_line + offset}", self.text_field)
                if text:
                    out.append(text)
        return out


def _json_text(raw: bytes, where: str, text_field: str) -> str:
    try:
        record = json.loads(raw.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg}); expected one JSON object per line") from None
    if not isinstance(record, dict) or text_field not in record:
        raise DataError(f"{where}: no {text_field!r} field; set data.text_field to the field holding the text")
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, expected a string")
    return text


def _kind(path: Path) -> tuple[str, str | None]:
    """('jsonl' | 'text' | 'parquet', compression suffix or None) from the file name."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes[-1] if suffixes and suffixes[-1] in COMPRESSED_SUFFIXES else None
    inner = suffixes[-2] if compression and len(suffixes) >= 2 else (suffixes[-1] if suffixes and not compression
                                                                      else "")
    if inner == PARQUET_SUFFIX and not compression:
        return "parquet", None
    return ("jsonl" if inner in JSON_LINES_SUFFIXES else "text"), compression


def check_readable(files: Iterable[Path]) -> None:
    """Say, before any work starts, which optional reader a file needs and is missing."""
    for file in files:
        kind, compression = _kind(Path(file))
        if kind == "parquet" and importlib.util.find_spec("pyarrow") is None:
            raise DataError(f"data.corpus: {file} is parquet, which needs pyarrow: pip install 'keel[parquet]'")
        if compression in (".zst", ".zstd") and importlib.util.find_spec("zstandard") is None:
            raise DataError(f"data.corpus: {file} is zstd-compressed, which needs zstandard: pip install zstandard")


def _open_binary(path: Path, compression: str | None) -> BinaryIO:
    try:
        raw = open(path, "rb")
    except OSError as exc:
        raise DataError(f"data.corpus: cannot read {path} ({exc.strerror or exc})") from None
    if compression == ".gz":
        return gzip.GzipFile(fileobj=raw)  # type: ignore[return-value]
    if compression in (".zst", ".zstd"):
        import zstandard

        # read_across_frames: files made by `zstd` CLI or pzstd may hold several frames.
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw  # type: ignore[return-value]


def _read_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, EOFError]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def iter_units(files: Iterable[Path], text_field: str = "text", unit_bytes: int = UNIT_BYTES) -> Iterator[Unit]:
    """Every file's documents as size-capped batches, in file order."""
    texts: list[str] = []
    size = 0
    for file in files:
        file = Path(file)
        kind, compression = _kind(file)
        if kind == "text":
            text = _read_text(file, compression)
            if text:
                texts.append(text)
                size += len(text)
            if size >= unit_bytes:
                yield Unit(texts=tuple(texts))
                texts, size = [], 0
            continue
        if texts:  # keep the order: flush plain texts before another kind of file
            yield Unit(texts=tuple(texts))
            texts, size = [], 0
        if kind == "jsonl":
            yield from _json_line_units(file, compression, text_field, unit_bytes)
        else:
            yield from _parquet_units(file, text_field, unit_bytes)
    if texts:
        yield Unit(texts=tuple(texts))


def iter_documents(files: Iterable[Path], text_field: str = "text") -> Iterator[str]:
    """Yield non-empty documents: one per JSON line or parquet row, otherwise one per (decompressed) file."""
    for unit in iter_units(files, text_field):
        yield from unit.documents()


def _read_text(file: Path, compression: str | None) -> str:
    try:
        with _open_binary(file, compression) as handle:
            return handle.read().decode("utf-8", errors="replace")
    except _read_errors() as exc:
        raise DataError(f"data.corpus: cannot read {file} ({exc}); is it complete?") from None


def _json_line_units(file: Path, compression: str | None, text_field: str, unit_bytes: int) -> Iterator[Unit]:
    lines: list[bytes] = []
    size, first = 0, 1
    lineno = 0
    try:
        with _open_binary(file, compression) as handle:
            for lineno, line in enumerate(handle, start=1):
                lines.append(line)
                size += len(line)
                if size >= unit_bytes:
                    yield Unit(lines=tuple(lines), source=str(file), first_line=first, text_field=text_field)
                    lines, size, first = [], 0, lineno + 1
    except _read_errors() as exc:
        raise DataError(f"data.corpus: cannot read {file} after line {lineno} ({exc}); is it complete?") from None
    if lines:
        yield Unit(lines=tuple(lines), source=str(file), first_line=first, text_field=text_field)


def _parquet_units(file: Path, text_field: str, unit_bytes: int) -> Iterator[Unit]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"data.corpus: {file} is not a readable parquet file ({exc})") from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise DataError(f"{file}: no column {text_field!r} (columns: {', '.join(names)}); set data.text_field")
    column_type = parquet.schema_arrow.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{file}: column {text_field!r} is {column_type}, expected strings")
    texts: list[str] = []
    size = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_ROWS, columns=[text_field]):  # a row group at a time
        for text in batch.column(0).to_pylist():
            if text:  # nulls and empty strings are no documents
                texts.append(text)
                size += len(text)
        if size >= unit_bytes:
            yield Unit(texts=tuple(texts))
            texts, size = [], 0
    if texts:
        yield Unit(texts=tuple(texts))
