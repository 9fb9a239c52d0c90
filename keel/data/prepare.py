"""Turn a corpus spec into a tokenizer plus a token store, once, and cache the result.

The cache key covers everything the output depends on (file list, sizes, mtimes, vocabulary size, text field,
format version), so editing the corpus or the config re-prepares, and anything else reuses. An entry becomes
visible only by renaming a finished directory into place, with `done.json` written last inside it, so a crash
or two racing ranks can never leave a half-built entry behind.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from keel.data.atomic import temp_sibling, write_atomic
from keel.data.corpus import iter_documents, resolve_corpus
from keel.data.errors import DataError
from keel.data.indexed import IndexedDataset, IndexedDatasetWriter
from keel.data.tokenizer import Tokenizer, train_tokenizer

FORMAT_VERSION = 1  # bump whenever tokenizer settings or the on-disk layout change
TOKENIZER_NAME = "tokenizer"  # -> tokenizer.model
DATA_NAME = "data"  # -> data.bin / data.idx
DONE_NAME = "done.json"
_BATCH_CHARS = 4_000_000  # text per encode_batch call: large enough to keep every thread busy


@dataclass(frozen=True)
class PreparedData:
    tokenizer_path: Path
    data_prefix: Path
    num_tokens: int
    num_docs: int


def prepare_corpus(
    files: list[Path], out_dir: Path, vocab_size: int, text_field: str = "text", progress: bool = True,
    tokenizer: Path | None = None,
) -> PreparedData:
    """Train a tokenizer on `files` (or copy the given `tokenizer`), then tokenize every document (each followed
    by EOS) into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    documents = iter_documents(files, text_field)
    first = next(documents, None)
    if first is None:
        raise DataError(f"data.corpus: the {len(files)} matched file(s) contain no text; point it at non-empty files")
    if tokenizer is not None:  # a blend's sources share the tokenizer trained on their union
        shutil.copyfile(tokenizer, out_dir / f"{TOKENIZER_NAME}.model")
        tokenizer = Tokenizer(out_dir / f"{TOKENIZER_NAME}.model")
    else:
        if progress:
            tqdm.write(f"keel: training a {vocab_size}-token tokenizer on {len(files)} file(s)", file=sys.stderr)
        tokenizer = train_tokenizer(itertools.chain([first], documents), vocab_size, out_dir / TOKENIZER_NAME)
    eos = tokenizer.eos_id
    bar = tqdm(total=len(files), unit="file", desc="keel: tokenizing", disable=not progress, file=sys.stderr)
    with bar, IndexedDatasetWriter(out_dir / DATA_NAME, tokenizer.vocab_size) as writer:
        for batch, files_done in _batches(files, text_field):
            for ids in tokenizer.encode_batch(batch):
                ids.append(eos)
                writer.add_document(ids)
            bar.update(files_done)
            bar.set_postfix(tokens=f"{writer.num_tokens:,}")
    return PreparedData(tokenizer.model_path, out_dir / DATA_NAME, writer.num_tokens, writer.num_docs)


def _batches(files: list[Path], text_field: str) -> Iterator[tuple[list[str], int]]:
    """Group documents into ~_BATCH_CHARS batches; also report how many files each batch finished."""
    batch: list[str] = []
    size = files_done = 0
    for file in files:
        for doc in iter_documents([file], text_field):
            batch.append(doc)
            size += len(doc)
            if size >= _BATCH_CHARS:
                yield batch, files_done
                batch, size, files_done = [], 0, 0
        files_done += 1
    if batch or files_done:
        yield batch, files_done


def corpus_fingerprint(files: list[Path], vocab_size: int, text_field: str, tokenizer: Path | None = None) -> str:
    """A short hash of everything a prepared corpus depends on."""
    entries = []
    for file in sorted(files):
        try:
            stat = file.stat()
        except OSError as exc:
            raise DataError(f"data.corpus: cannot read {file} ({exc.strerror or exc})") from None
        entries.append([str(file), stat.st_size, stat.st_mtime_ns])
    key = {"format": FORMAT_VERSION, "vocab_size": vocab_size, "text_field": text_field, "files": entries}
    if tokenizer is not None:
        key["tokenizer_sha256"] = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def ensure_prepared(
    spec: list[str],
    cache_dir: str | Path,
    vocab_size: int,
    text_field: str = "text",
    base_dir: Path | None = None,
    progress: bool = True,
    tokenizer: Path | None = None,
) -> PreparedData:
    """Return the cached preparation of `spec`, building it first if no complete entry exists (with the given
    `tokenizer` model file, or one trained on `spec`)."""
    files = resolve_corpus(spec, base_dir)
    cache = Path(os.path.expanduser(str(cache_dir)))
    entry = cache / corpus_fingerprint(files, vocab_size, text_field, tokenizer)
    found = _load_entry(entry)
    if found is None and entry.exists():
        _discard_damaged(entry)
        found = _load_entry(entry)
    if found is not None:
        return found
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = temp_sibling(entry)
        tmp.mkdir()
    except OSError as exc:
        raise DataError(
            f"data.cache_dir: cannot write to {cache} ({exc.strerror or exc}); set a writable path"
        ) from None
    try:
        prepared = prepare_corpus(files, tmp, vocab_size, text_field, progress, tokenizer)
        _write_done(tmp, prepared, spec, files)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not entry.exists():
                raise
            # Another process finished first: keep its entry, drop ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    found = _load_entry(entry)
    if found is None:
        raise DataError(f"{entry}: cache entry is incomplete; delete it and re-run `keel prepare`")
    return found


def _write_done(out_dir: Path, prepared: PreparedData, spec: list[str], files: list[Path]) -> None:
    record = {
        "format": FORMAT_VERSION,
        "tokenizer": prepared.tokenizer_path.name,
        "data_prefix": prepared.data_prefix.name,
        "num_tokens": prepared.num_tokens,
        "num_docs": prepared.num_docs,
        "spec": list(spec),
        "num_files": len(files),
        "corpus_bytes": sum(f.stat().st_size for f in files),
    }
    write_atomic(out_dir / DONE_NAME, json.dumps(record, indent=2).encode())


def _load_entry(entry: Path) -> PreparedData | None:
    """The entry's PreparedData if it is complete and its files open cleanly, else None."""
    try:
        record = json.loads((entry / DONE_NAME).read_text())
        prepared = PreparedData(
            tokenizer_path=entry / record["tokenizer"],
            data_prefix=entry / record["data_prefix"],
            num_tokens=int(record["num_tokens"]),
            num_docs=int(record["num_docs"]),
        )
        dataset = IndexedDataset(prepared.data_prefix)
        if not prepared.tokenizer_path.is_file() or dataset.num_tokens != prepared.num_tokens:
            return None
    except (OSError, ValueError, KeyError, TypeError):  # DataError is a ValueError
        return None
    return prepared


def _discard_damaged(entry: Path) -> None:
    """Remove an entry that exists but does not load (complete entries only appear whole, so it is damaged)."""
    if _load_entry(entry) is not None:  # another process may have just renamed a finished one into place
        return
    trash = entry.with_name(f".{entry.name}.{os.getpid()}.trash")
    try:
        os.rename(entry, trash)  # atomic: no one else sees a half-deleted entry
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
