"""Turn a corpus spec into a tokenizer plus a token store, once, and cache the result.

The cache key covers everything the output depends on (file list, sizes, mtimes, the vocabulary size to train
or the given tokenizer's hash, the token files named, text field, format version), so editing the corpus or
the config re-prepares, and anything else reuses; the worker count is not in it (the output is the same). An
entry becomes visible only by renaming a finished directory into place, with `done.json` written last inside
it, so a crash or two racing ranks can never leave a half-built entry behind.
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

from keel.data.corpus import CorpusSources, iter_documents, resolve_sources
from keel.data.errors import DataError
from keel.data.indexed import IndexedDataset, IndexedDatasetWriter
from keel.data.token_check import check_token_file
from keel.data.tokenize_pool import BatchTokenizer, default_workers, tokenize_in_order
from keel.data.tokenizer import train_tokenizer
from keel.data.tokenizer_source import load_or_train_tokenizer, load_tokenizer, source_sha256
from keel.run_dir import temp_sibling, write_atomic

# bump whenever tokenizer settings or the on-disk layout change (2: Megatron .bin/.idx)
FORMAT_VERSION = 2
# -> tokenizer.model (trained or a given sentencepiece), .json or a directory (HF)
TOKENIZER_NAME = "tokenizer"
DATA_NAME = "data"  # -> data.bin / data.idx / data.json
DONE_NAME = "done.json"
# Text per worker task: small enough that the 4 x workers in flight stay a few MB (a worker holds its batch's ids
# as Python ints, ~40 bytes each, before packing them) and that one slow batch does not idle the other workers.
_BATCH_CHARS = 256_000


@dataclass(frozen=True)
class PreparedData:
    tokenizer_path: Path | None
    data_prefix: Path  # the first of `sources`
    num_tokens: int  # over all sources
    num_docs: int
    sources: tuple[
        Path, ...
    ] = ()  # every token file of the corpus: the tokenized text, then given token files
    vocab_size: int = 0  # the vocabulary every source was checked against


def prepare_corpus(
    files: list[Path],
    out_dir: Path,
    vocab_size: int,
    text_field: str = "text",
    progress: bool = True,
    *,
    tokenizer: BatchTokenizer | None = None,
    workers: int | None = None,
) -> PreparedData:
    """Tokenize every document of `files` (each followed by EOS) into `out_dir`, on `workers` processes.

    Without a `tokenizer` one is trained on `files` first (a second pass over the text); with one, the text is
    read once.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    empty = f"data.corpus: the {len(files)} matched file(s) contain no text; point it at non-empty files"
    if tokenizer is None:
        documents = iter_documents(files, text_field)
        first = next(documents, None)
        if first is None:
            raise DataError(empty)
        if progress:
            tqdm.write(
                f"keel: training a {vocab_size}-token tokenizer on {len(files)} file(s)",
                file=sys.stderr,
            )
        tokenizer = train_tokenizer(
            itertools.chain([first], documents), vocab_size, out_dir / TOKENIZER_NAME
        )
    workers = workers or default_workers()
    model_path = _tokenizer_path(tokenizer)
    name = (
        Path(model_path).name if model_path and Path(model_path).parent == out_dir else model_path
    )
    writer = IndexedDatasetWriter(
        out_dir / DATA_NAME,
        tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        bos_id=getattr(tokenizer, "bos_id", None),
        pad_id=getattr(tokenizer, "pad_id", None),
        tokenizer=str(name or type(tokenizer).__name__),
        tokenizer_hash=tokenizer_fingerprint(tokenizer),
    )
    bar = tqdm(
        unit="tok",
        unit_scale=True,
        desc=f"keel: tokenizing ({workers} worker{'s' * (workers > 1)})",
        disable=not progress,
        file=sys.stderr,
    )
    with bar, writer:
        files_done = 0
        for ids, lengths, finished in tokenize_in_order(
            tokenizer, _batches(files, text_field), workers
        ):
            writer.add_documents(ids, lengths)
            files_done += finished
            bar.update(int(ids.size))
            bar.set_postfix_str(
                f"{files_done}/{len(files)} files, {writer.num_docs:,} docs", refresh=False
            )
        if writer.num_docs == 0:
            raise DataError(empty)
    path = Path(model_path) if model_path else None
    return PreparedData(
        path,
        out_dir / DATA_NAME,
        writer.num_tokens,
        writer.num_docs,
        (out_dir / DATA_NAME,),
        tokenizer.vocab_size,
    )


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


def _tokenizer_path(tokenizer: BatchTokenizer) -> Path | None:
    """Where the tokenizer's files are (keel.data.tokenizer.Tokenizer: `path`; other objects: `model_path`)."""
    path = getattr(tokenizer, "path", None) or getattr(tokenizer, "model_path", None)
    return Path(path) if path else None


def tokenizer_fingerprint(tokenizer: BatchTokenizer) -> str:
    """A hash of the tokenizer's files (or its own `fingerprint`/`sha256`), so a different tokenizer re-prepares."""
    named = getattr(tokenizer, "fingerprint", None) or getattr(tokenizer, "sha256", None)
    if isinstance(named, str):
        return named[:16]
    path = _tokenizer_path(tokenizer)
    files = (
        sorted(p for p in Path(path).rglob("*") if p.is_file())
        if path and Path(path).is_dir()
        else [Path(path)]
        if path and Path(path).is_file()
        else []
    )
    if not files:
        raise DataError(
            f"tokenizer {type(tokenizer).__name__}: has neither a `fingerprint` nor a `model_path` "
            "file to hash; the prepared-corpus cache cannot tell it from another tokenizer"
        )
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def corpus_fingerprint(
    files: list[Path],
    vocab_size: int,
    text_field: str,
    token_files: list[Path] = (),
    tokenizer: str | None = None,
) -> str:
    """A short hash of everything a prepared corpus depends on (the given tokenizer replaces `vocab_size`)."""
    entries = [[str(file), *_stat(file)] for file in sorted(files)]
    stores = [
        [str(prefix), *_stat(Path(f"{prefix}.bin")), *_stat(Path(f"{prefix}.idx"))]
        for prefix in token_files
    ]
    key = {"format": FORMAT_VERSION, "text_field": text_field, "files": entries}
    key.update({"token_files": stores} if stores else {})
    key.update({"tokenizer": tokenizer} if tokenizer else {"vocab_size": vocab_size})
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _stat(file: Path) -> tuple[int, int]:
    try:
        stat = file.stat()
    except OSError as exc:
        raise DataError(f"data.corpus: cannot read {file} ({exc.strerror or exc})") from None
    return stat.st_size, stat.st_mtime_ns


def ensure_prepared(
    spec: list[str],
    cache_dir: str | Path,
    vocab_size: int,
    text_field: str = "text",
    base_dir: Path | None = None,
    progress: bool = True,
    *,
    tokenizer: BatchTokenizer | Path | None = None,
    workers: int | None = None,
) -> PreparedData:
    """Return the cached preparation of `spec`, building it first if no complete entry exists.

    Text is tokenized into the cache (with `tokenizer`, or one trained on it); token files named in `spec` are
    used in place, checked on every call (keel/data/token_check.py: the whole index streamed and a bounded id
    sample, cheap enough to repeat, so a file changed behind the cache's back is still caught before launch; ids
    the sample does not read are checked at the sample, in training).
    `tokenizer` may be a given tokenizer's path (keel.data.tokenizer_source.resolve_tokenizer_path): it is keyed
    by its files' hash without loading it, and copied into the entry, so the entry's tokens keep their meaning
    if the source moves or changes.
    """
    sources = resolve_sources(spec, base_dir)
    _check_tokenizer_for(sources, tokenizer)
    cache = Path(os.path.expanduser(str(cache_dir)))
    source = Path(tokenizer) if isinstance(tokenizer, (str, Path)) else None
    if source is not None:
        tokenizer_key = source_sha256(source)[:16]
    else:
        tokenizer_key = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    entry = cache / corpus_fingerprint(
        sources.text_files, vocab_size, text_field, sources.token_files, tokenizer_key
    )
    found = _load_entry(entry)
    if found is None and entry.exists():
        _discard_damaged(entry)
        found = _load_entry(entry)
    if found is not None:
        _check_token_files(sources.token_files, tokenizer, progress)
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
        made = None
        _check_token_files(sources.token_files, tokenizer, progress)
        if source is not None:  # the entry's own copy of the given tokenizer
            tokenizer = load_or_train_tokenizer(source, (), vocab_size, tmp, TOKENIZER_NAME)
            if progress:
                tqdm.write(f"keel: tokenizing with {source}", file=sys.stderr)
        if sources.text_files:
            made = prepare_corpus(
                sources.text_files,
                tmp,
                vocab_size,
                text_field,
                progress,
                tokenizer=tokenizer,
                workers=workers,
            )
        given = [_token_file_record(prefix, tokenizer.vocab_size) for prefix in sources.token_files]
        _write_done(tmp, made, given, tokenizer, spec, sources, source, tokenizer_key)
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


def _check_tokenizer_for(sources: CorpusSources, tokenizer: BatchTokenizer | None) -> None:
    if sources.token_files and tokenizer is None:
        raise DataError(
            f"data.corpus: {sources.token_files[0]} is a token file, whose ids mean something only with "
            "the tokenizer that made it; set data.tokenizer to that tokenizer"
        )


def _check_token_files(
    prefixes: list[Path], tokenizer: BatchTokenizer | Path | None, progress: bool
) -> None:
    """The given token files' pre-launch check: each whole index and a bounded id sample against the tokenizer's
    vocabulary (keel/data/token_check.py)."""
    if not prefixes:
        return
    vocab = (
        load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    ).vocab_size
    for prefix in prefixes:
        if progress:
            tqdm.write(
                f"keel: checking {prefix}.idx and an id sample against the tokenizer's {vocab} ids",
                file=sys.stderr,
            )
        check_token_file(prefix, vocab)


def _token_file_record(prefix: Path, vocab_size: int) -> dict[str, object]:
    dataset = IndexedDataset(prefix, vocab_size=vocab_size)
    return {"prefix": str(prefix), "num_tokens": dataset.num_tokens, "num_docs": len(dataset)}


def _write_done(
    out_dir: Path,
    made: PreparedData | None,
    given: list[dict[str, object]],
    tokenizer: BatchTokenizer | None,
    spec: list[str],
    sources: CorpusSources,
    source: Path | None = None,
    source_key: str | None = None,
) -> None:
    path = made.tokenizer_path if made is not None else None
    path = path or (_tokenizer_path(tokenizer) if tokenizer is not None else None)
    if path is not None and path.parent == out_dir:
        tokenizer_path = path.name  # trained or copied here: relative, the entry moves
    else:
        tokenizer_path = str(path) if path else None
    stores = (
        given
        if made is None
        else [
            {
                "prefix": made.data_prefix.name,
                "num_tokens": made.num_tokens,
                "num_docs": made.num_docs,
            }
        ]
        + given
    )
    record = {
        "format": FORMAT_VERSION,
        "tokenizer": tokenizer_path,
        "vocab_size": made.vocab_size if made is not None else tokenizer.vocab_size,
        "sources": stores,
        "spec": list(spec),
        "num_files": len(sources.text_files),
        "corpus_bytes": sum(f.stat().st_size for f in sources.text_files),
        "tokenizer_source": "train"
        if source is None and tokenizer is None
        else str(source or tokenizer_path),
        "tokenizer_source_sha256": source_key,
    }
    write_atomic(out_dir / DONE_NAME, json.dumps(record, indent=2).encode())


def _load_entry(entry: Path) -> PreparedData | None:
    """The entry's PreparedData if it is complete and its files open cleanly, else None."""
    try:
        record = json.loads((entry / DONE_NAME).read_text())
        if record.get("format") != FORMAT_VERSION:
            return None
        # absolute stays absolute
        tokenizer = None if record["tokenizer"] is None else entry / record["tokenizer"]
        vocab = int(record["vocab_size"])
        prefixes = []
        for source in record["sources"]:
            prefix = entry / source["prefix"]
            dataset = IndexedDataset(prefix, vocab_size=vocab)
            if (dataset.num_tokens, len(dataset)) != (source["num_tokens"], source["num_docs"]):
                return None
            prefixes.append(prefix)
        if not prefixes or (tokenizer is not None and not tokenizer.exists()):
            return None
    except (OSError, ValueError, KeyError, TypeError):  # DataError is a ValueError
        return None
    return PreparedData(
        tokenizer,
        prefixes[0],
        sum(s["num_tokens"] for s in record["sources"]),
        sum(s["num_docs"] for s in record["sources"]),
        tuple(prefixes),
        vocab,
    )


def _discard_damaged(entry: Path) -> None:
    """Remove an entry that exists but does not load (complete entries only appear whole, so it is damaged)."""
    # another process may have just renamed a finished one into place
    if _load_entry(entry) is not None:
        return
    trash = entry.with_name(f".{entry.name}.{os.getpid()}.trash")
    try:
        os.rename(entry, trash)  # atomic: no one else sees a half-deleted entry
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
