"""Tokenize batches of documents on N worker processes, returned in input order, with bounded memory.

Worker processes own a tokenizer each (its own threads pinned to 1, so N workers use N cores and never
oversubscribe) and send back flat numpy arrays (ids with EOS appended, and per-document lengths), which pickle
as raw buffers. At most `4 * workers` batches are in flight (slack for the others while one slow batch holds up
the ordered output), so the reader never runs ahead of the tokenizers and memory depends on the batch size, not
the corpus. The pool is hand-made rather than `multiprocessing.Pool.imap`
for two reasons: `imap` feeds its task queue from the whole input iterator as fast as it can (no back-pressure),
and a worker that dies leaves `imap` waiting forever, where this one raises.
"""

from __future__ import annotations

import inspect
import itertools
import multiprocessing as mp
import os
import queue
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from keel.data.errors import DataError

T = TypeVar("T")
_POLL_S = 1.0
# Thread-count knobs of the tokenizer libraries Keel may load (HF tokenizers' rayon pool, OpenMP).
_PIN_ENV = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


class BatchTokenizer(Protocol):
    """What tokenizing needs from a tokenizer (keel.data.Tokenizer has it)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


def default_workers() -> int:
    """Every core this process may run on."""
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


def encode_documents(
    tokenizer: BatchTokenizer, texts: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """Every text's ids followed by EOS, back to back (int64), and each document's length."""
    kwargs = (
        {"num_threads": 1}
        if "num_threads" in inspect.signature(tokenizer.encode_batch).parameters
        else {}
    )
    encoded = tokenizer.encode_batch(list(texts), **kwargs)
    eos = [tokenizer.eos_id]
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter(
        itertools.chain.from_iterable(itertools.chain(ids, eos) for ids in encoded),
        dtype=np.int64,
        count=int(lengths.sum()),
    )
    return flat, lengths


def _work(tokenizer: BatchTokenizer, tasks: Any, results: Any) -> None:
    """Worker loop: (seq, texts) in, (seq, ids, lengths) or (seq, error line) out, until None."""
    os.environ.update(_PIN_ENV)
    while (task := tasks.get()) is not None:
        seq, texts = task
        try:
            results.put((seq, encode_documents(tokenizer, texts)))
        except Exception as exc:  # reported in the parent as one line; the worker keeps serving
            results.put((seq, f"{type(exc).__name__}: {exc}"))


def tokenize_in_order(
    tokenizer: BatchTokenizer, batches: Iterable[tuple[list[str], T]], workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray, T]]:
    """Yield (ids, lengths, tag) for every (texts, tag) batch, in input order; byte-identical for any `workers`."""
    if workers < 1:
        raise DataError(f"--workers: must be >= 1, got {workers}")
    if workers == 1:  # no processes: the same encoding, in this one
        for texts, tag in batches:
            yield (*encode_documents(tokenizer, texts), tag)
        return
    # fork: workers inherit the loaded tokenizer instead of unpickling it (spawn where fork does not exist)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_work, args=(tokenizer, tasks, results), daemon=True)
        for _ in range(workers)
    ]
    for proc in procs:
        proc.start()
    try:
        yield from _ordered(iter(batches), tasks, results, procs, window=4 * workers)
    finally:
        for _ in procs:
            tasks.put(None)
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for q in (tasks, results):
            q.close()
            q.cancel_join_thread()


def _ordered(
    batches: Iterator[tuple[list[str], T]], tasks: Any, results: Any, procs: list, window: int
) -> Iterator[tuple[np.ndarray, np.ndarray, T]]:
    tags: dict[int, T] = {}
    done: dict[int, Any] = {}
    sent = emitted = 0
    exhausted = False
    while True:
        while not exhausted and sent - emitted < window:
            item = next(batches, None)
            if item is None:
                exhausted = True
                break
            texts, tags[sent] = item
            tasks.put((sent, texts))
            sent += 1
        if emitted == sent:
            return
        while emitted not in done:
            try:
                seq, payload = results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(
                        f"a tokenizer worker died (exit code {dead[0].exitcode}); "
                        "out of memory? retry with fewer --workers"
                    ) from None
                continue
            done[seq] = payload
        payload = done.pop(emitted)
        if isinstance(payload, str):
            raise DataError(f"tokenizing failed in a worker: {payload}")
        yield (*payload, tags.pop(emitted))
        emitted += 1
