"""Documents out of one corpus file, streamed: plain text, JSON lines, parquet; gzip or zstd compressed.

Each reader yields one document at a time and never holds more than a line (JSON lines), a row group
(parquet) or the file itself (plain text, which is one document), so corpus size never shows up in memory.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from keel.data.errors import DataError

JSON_LINES_SUFFIXES = frozenset({".jsonl", ".ndjson", ".json"})
PARQUET_SUFFIXES = frozenset({".parquet", ".pq"})
_COMPRESSED = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}


def file_documents(file: Path, text_field: str = "text") -> Iterator[str]:
    """Yield the non-empty documents of `file`: one per JSON line or parquet row, otherwise the whole file."""
    file = Path(file)
    suffixes = [s.lower() for s in file.suffixes]
    compression = _COMPRESSED.get(suffixes[-1]) if suffixes else None
    inner = (
        (suffixes[-2] if len(suffixes) > 1 else "")
        if compression
        else (suffixes[-1] if suffixes else "")
    )
    if inner in PARQUET_SUFFIXES and compression is None:
        yield from _parquet_documents(file, text_field)
        return
    try:
        handle = _open_text(file, compression)
    except OSError as exc:
        raise DataError(f"data.corpus: cannot read {file} ({exc.strerror or exc})") from None
    with handle:
        try:
            if inner in JSON_LINES_SUFFIXES:
                yield from _json_lines(handle, file, text_field)
            else:
                text = handle.read()
                if text:
                    yield text
        except (OSError, EOFError, ValueError) as exc:
            if isinstance(exc, DataError):
                raise
            raise DataError(
                f"data.corpus: {file} is damaged ({exc}); re-download or recompress it"
            ) from None


def _open_text(file: Path, compression: str | None) -> IO[str]:
    if compression == "gzip":
        return gzip.open(file, "rt", encoding="utf-8", errors="replace")
    if compression == "zstd":
        try:
            import zstandard  # optional here: a missing one gets its own line below
        except ImportError:
            raise DataError(
                f"data.corpus: {file} is zstd-compressed; pip install zstandard"
            ) from None
        raw = open(file, "rb")
        stream = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.TextIOWrapper(stream, encoding="utf-8", errors="replace")
    return open(file, encoding="utf-8", errors="replace")


def _json_lines(handle: IO[str], file: Path, text_field: str) -> Iterator[str]:
    for lineno, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        where = f"{file}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{where}: not valid JSON ({exc.msg}); expected one JSON object per line"
            ) from None
        if not isinstance(record, dict) or text_field not in record:
            raise DataError(
                f"{where}: no {text_field!r} field; set data.text_field to the field holding the text"
            )
        text = record[text_field]
        if not isinstance(text, str):
            raise DataError(
                f"{where}: field {text_field!r} is {type(text).__name__}, expected a string"
            )
        if text:
            yield text


def _parquet_documents(file: Path, text_field: str) -> Iterator[str]:
    """One row group at a time (the unit parquet compresses and stores), only the text column."""
    try:
        import pyarrow.parquet as pq  # optional dependency (the parquet extra)
        import pyarrow.types as pa_types  # the same
    except ImportError:
        raise DataError(
            f"data.corpus: {file} is parquet, which needs pyarrow: pip install 'keel[parquet]'"
        ) from None
    try:
        parquet = pq.ParquetFile(file)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"data.corpus: cannot read {file} as parquet ({exc})") from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise DataError(
            f"{file}: no {text_field!r} column (it has {', '.join(schema.names)}); "
            "set data.text_field to the column holding the text"
        )
    kind = schema.field(text_field).type
    if not (pa_types.is_string(kind) or pa_types.is_large_string(kind)):
        raise DataError(f"{file}: column {text_field!r} is {kind}, expected strings")
    with parquet:
        for group in range(parquet.num_row_groups):
            try:
                column = parquet.read_row_group(group, columns=[text_field]).column(0)
            except (OSError, ValueError) as exc:
                raise DataError(
                    f"data.corpus: {file} row group {group} is damaged ({exc})"
                ) from None
            for text in column.to_pylist():
                if text:
                    yield text
