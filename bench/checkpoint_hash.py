"""What checkpoint hashing costs: sha256 per thread, a save's extra wait, and load-time verification throughput.

    python bench/checkpoint_hash.py [--size-mb 512] [--files 4] [--repeats 3] [--dir /tmp]

Prints (1) sha256 GB/s on one thread over an in-memory buffer and the aggregate on 2 and 4 threads (hashlib
releases the GIL on large buffers); (2) the save side: the same files written with torch.save plainly and through
Keel's `WrittenFiles` (hashed on 2 threads as each closes, overlapping the next write), interleaved A/B, and the
extra wall time; (3) verification (`checkpoint_verify.verify`, 4 threads) from the page cache, and cold where
the kernel lets us drop the files' pages (posix_fadvise DONTNEED, after fsync); (4) the projection to a 70B model
on 512 ranks: bf16 weights + fp32 master + two Adam moments = 14 bytes per parameter, each rank verifying 1/512.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from page_cache import drop_cache  # noqa: E402  (bench/, the script's own directory)

from keel.training.checkpoint.verify import Entry, describe, pieces, verify  # noqa: E402
from keel.training.checkpoint.writes import WrittenFiles  # noqa: E402

BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weights, fp32 master, Adam exp_avg and exp_avg_sq


def sha256_rate(buffer: bytes, threads: int, repeats: int) -> float:
    """Aggregate GB/s of `threads` threads each hashing `buffer` once (best of `repeats`)."""
    best = 0.0
    for _ in range(repeats):
        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            list(pool.map(lambda _: hashlib.sha256(buffer).digest(), range(threads)))
            best = max(best, threads * len(buffer) / (time.perf_counter() - start) / 1e9)
    return best


def _entry(path: Path) -> Entry:
    size, chunks = describe(path)
    return Entry(size, chunks=tuple(chunks))


def save_files(directory: Path, tensors: list[torch.Tensor], hashed: bool) -> float:
    """Seconds to write every tensor as a file (and, `hashed`, to have every hash): what a save waits for."""
    start = time.perf_counter()
    written = WrittenFiles(rank=0) if hashed else None
    for i, tensor in enumerate(tensors):
        path = directory / f"shard{i}.pt"
        if written is None:
            torch.save({"state": tensor}, path)
        else:
            written.write(path, lambda target, t=tensor: torch.save({"state": t}, target))
    if written is not None:
        error, _ = written.result()
        assert not error, error
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size-mb", type=int, default=512, help="total bytes of the files written and verified"
    )
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--params", type=float, default=70e9)
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument(
        "--fs-gbps", type=float, default=100.0, help="assumed aggregate read GB/s of the cluster FS"
    )
    args = parser.parse_args()
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}"
    )

    buffer = os.urandom(256 << 20)
    per_thread = sha256_rate(buffer, 1, args.repeats)
    rates = {n: sha256_rate(buffer, n, args.repeats) for n in (2, 4)}
    print(
        f"sha256: {per_thread:.2f} GB/s on 1 thread; {rates[2]:.2f} GB/s on 2, {rates[4]:.2f} GB/s on 4 "
        "(aggregate, bounded by free cores)"
    )
    del buffer

    numel = (args.size_mb << 20) // args.files // 4
    tensors = [torch.randn(numel) for _ in range(args.files)]
    total_gb = args.files * numel * 4 / 1e9
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        plain, hashed = [], []
        for _ in range(args.repeats):  # interleaved A/B: the machine's drift hits both arms alike
            plain.append(save_files(directory, tensors, hashed=False))
            hashed.append(save_files(directory, tensors, hashed=True))
        a, b = statistics.median(plain), statistics.median(hashed)
        print(
            f"save of {total_gb:.2f} GB in {args.files} files: plain {a:.2f} s, hashed on 2 threads {b:.2f} s "
            f"(median of {args.repeats}); extra {b - a:+.2f} s = {b / a:.2f}x"
        )
        paths = sorted(directory.iterdir())
        files = {p.name: _entry(p) for p in paths}
        work = list(pieces(files))
        warm = min(_timed(lambda: verify(directory, files, work)) for _ in range(args.repeats))
        print(
            f"verify (4 threads, page cache): {total_gb / warm:.2f} GB/s ({warm:.2f} s for {total_gb:.2f} GB)"
        )
        if drop_cache(*paths):
            cold = _timed(lambda: verify(directory, files, work))
            print(f"verify (4 threads, pages dropped): {total_gb / cold:.2f} GB/s ({cold:.2f} s)")

    total_tb = args.params * BYTES_PER_PARAM / 1e12
    per_rank_gb = total_tb * 1e3 / args.ranks
    # ZeRO-1/2: the rank's optimizer shard is its largest file
    largest_gb = args.params * 12 / args.ranks / 1e9
    print(
        f"projection: {args.params / 1e9:.0f}B params x {BYTES_PER_PARAM} B = {total_tb:.2f} TB per checkpoint, "
        f"{per_rank_gb:.2f} GB per rank of {args.ranks} (largest file {largest_gb:.2f} GB)."
    )
    print(
        f"  save: {per_rank_gb / per_thread:.1f} s of hashing per rank on 2 background threads, overlapping the "
        f"writes; the save waits at most for its last file's hash, {largest_gb / per_thread:.1f} s "
        f"(torch.save itself wrote {total_gb / a:.2f} GB/s here: {per_rank_gb / (total_gb / a):.1f} s per rank)"
    )
    cpu_s = per_rank_gb / (4 * per_thread)
    fs_s = total_tb * 1e3 / args.fs_gbps
    print(
        f"  load: each rank verifies 1/{args.ranks}: {cpu_s:.1f} s of CPU at 4 threads x {per_thread:.2f} GB/s, "
        f"all ranks at once; the checkpoint is read once in total, {fs_s:.0f} s at an assumed {args.fs_gbps:.0f} "
        f"GB/s aggregate filesystem read (--fs-gbps) — the slower of the two, ~{max(cpu_s, fs_s):.0f} s per load"
    )


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
