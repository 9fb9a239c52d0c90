"""What the token-file checks cost (keel/data/token_check.py, keel/training/data_stop.py).

Builds a synthetic Megatron-format token file with many sequences in a scratch directory (default 20M sequences
of ~50 uint16 ids: a 400 MB index, a 2 GB .bin, every byte real) and times, cold (the files' pages dropped with
posix_fadvise after an fsync) and warm:

- the pre-launch check: the whole index streamed, and the 4 MiB id sample;
- the full pass it replaces (IndexedDataset.validate: the index, then every id), with its id throughput, so its
  cost at other corpus sizes follows (it grows with the tokens, the pre-launch check with the sequences);
- the at-sample check: one vectorised min/max over a step's batch, for a few per-rank batch shapes.

    python bench/token_check.py [--sequences 20000000] [--tokens 50] [--dir /tmp/keel-token-bench] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from page_cache import drop_cache  # noqa: E402  (bench/, the script's own directory)

from keel.data import megatron_index as layout  # noqa: E402
from keel.data.indexed import IndexedDataset  # noqa: E402
from keel.data.token_check import check_id_sample, check_index, first_bad_row  # noqa: E402

VOCAB = 50_000


def build(prefix: Path, sequences: int, mean_tokens: int, seed: int = 0) -> int:
    """Write PREFIX.idx/.bin (one document per sequence, lengths uniform in [1, 2*mean)); returns the tokens."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(np.uint16)
    lengths_path = prefix.with_suffix(".lengths")
    with open(lengths_path, "wb+") as lengths, open(f"{prefix}.bin", "wb") as tokens:
        total = 0
        for first in range(0, sequences, layout.CHUNK):
            chunk = rng.integers(
                1, 2 * mean_tokens, min(layout.CHUNK, sequences - first), dtype=np.int32
            )
            lengths.write(chunk.astype("<i4").tobytes())
            tokens.write(rng.integers(0, VOCAB, int(chunk.sum()), dtype=np.uint16).tobytes())
            total += int(chunk.sum())
        with open(f"{prefix}.idx", "wb") as out:
            layout.write_index(out, dtype, lengths, sequences)
            layout.fsync_close(out)
        layout.fsync_close(tokens)
    lengths_path.unlink()
    return total


def timed(fn, cold: tuple[Path, ...] = ()) -> float:
    if cold:
        drop_cache(*cold)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def batch_check_ms(shape: tuple[int, int, int], repeats: int = 200) -> float:
    """Median ms of the at-sample check over one rank's step batch: `micro` micro-batches of [rows, seq_len + 1]."""
    micro, rows, width = shape
    batches = [torch.randint(0, VOCAB, (rows, width)) for _ in range(micro)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        assert first_bad_row(batches, VOCAB) is None
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=20_000_000)
    parser.add_argument("--tokens", type=int, default=50, help="mean ids per sequence")
    parser.add_argument("--dir", default="/tmp/keel-token-bench")
    parser.add_argument(
        "--keep", action="store_true", help="keep the files (and reuse them next time)"
    )
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    prefix = root / f"synthetic-{args.sequences}-{args.tokens}"
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    try:
        if not (idx.is_file() and bin_.is_file()):
            started = time.perf_counter()
            build(prefix, args.sequences, args.tokens)
            print(f"built in {time.perf_counter() - started:.1f} s")
        dataset = IndexedDataset(prefix, vocab_size=VOCAB)
        print(
            f"{args.sequences:,} sequences, {dataset.num_tokens:,} ids: index {idx.stat().st_size / 2**20:.0f} MiB,"
            f" .bin {bin_.stat().st_size / 2**30:.2f} GiB | load average {os.getloadavg()[0]:.1f}"
        )
        rows = [
            ("pre-launch: whole index streamed", lambda: check_index(prefix), (idx,)),
            ("pre-launch: 4 MiB id sample", lambda: check_id_sample(dataset, VOCAB), (bin_,)),
            (
                "full pass (validate): index + every id",
                lambda: dataset.validate(VOCAB),
                (idx, bin_),
            ),
        ]
        results = {}
        for name, fn, files in rows:
            cold, warm = timed(fn, files), timed(fn)
            results[name] = (cold, warm)
            print(f"{name:42s} cold {cold:8.3f} s   warm {warm:8.3f} s")
        full_cold = results["full pass (validate): index + every id"][0]
        index_cold = results["pre-launch: whole index streamed"][0]
        gib = bin_.stat().st_size / 2**30
        rate = gib / max(full_cold - index_cold, 1e-9)
        print(
            f"full pass id throughput (cold): {rate:.2f} GiB/s -> {40 / rate:.0f} s for a 20B-token uint16 corpus "
            f"(40 GiB), {600 / rate / 60:.0f} min for 300B"
        )
        for shape in [(4, 2, 33), (8, 4, 4097), (16, 1, 8193), (4, 8, 8193)]:
            ids = shape[0] * shape[1] * shape[2]
            print(
                f"at-sample check, {shape[0]} micro-batches of [{shape[1]}, {shape[2]}] ({ids:,} ids): "
                f"{batch_check_ms(shape):.3f} ms"
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
