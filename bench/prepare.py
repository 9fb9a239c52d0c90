"""`keel prepare`'s tokenizing speed with 1 and N worker processes, its output equality, and its peak memory.

Two inputs: the embedded default corpus (this Python's stdlib source, one document per file) and a JSON-lines
file of about `--size-mb` MB (default 1000) generated into a temporary directory from the default corpus text
(its files cut into ~40-line documents, shuffled per repetition) and deleted afterwards. Both arms tokenize
with the same trained tokenizer (the default corpus's, from the `keel train` cache: `--cache-dir`) with its
own threads pinned to 1, each in a fresh subprocess through `keel.data.prepare.prepare_corpus`, so the numbers
are Keel's real path (reading, worker processes, ordered writing) and each arm's peak RSS is its own.

It prints a table: seconds, tokens/s and the speed-up of N workers over 1 (target >= 1.7x at 2 workers on 2
cores), whether the N-worker files are byte-identical to the 1-worker ones (.bin, .idx and .json), and the
peak RSS of the writing process and of the largest worker against fixed + 12 bytes per document, where
"fixed" is the same arm's peak on a `--fixed-mb` (default 2) file from the same generator: memory that grows
with the corpus would show as the difference.

    python bench/prepare.py [--size-mb 1000] [--workers N] [--vocab-size 4096]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MB = 10**6
BYTES_PER_DOC = 12
_DOC_LINES = 40


def generate_jsonl(path: Path, size_mb: float, seed: int = 0) -> int:
    """Write ~size_mb MB of {"text": ...} lines cut from the default corpus; returns the document count."""
    from keel.data import default_corpus_files

    chunks = []
    for file in default_corpus_files():
        lines = file.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        chunks.extend("".join(lines[i : i + _DOC_LINES]) for i in range(0, len(lines), _DOC_LINES))
    encoded = [json.dumps({"text": c}) + "\n" for c in chunks if c.strip()]
    rng = random.Random(seed)
    target, written, docs = size_mb * MB, 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            rng.shuffle(encoded)
            for line in encoded:
                out.write(line)
                written += len(line)
                docs += 1
                if written >= target:
                    break
    return docs


def run_arm(args: argparse.Namespace) -> None:
    """Child mode: prepare one input with one worker count and print what it measured as JSON."""
    from keel.data import default_corpus_files, load_tokenizer, prepare_corpus

    files = default_corpus_files() if args.input == "default" else [Path(args.input)]
    tokenizer = load_tokenizer(args.tokenizer)
    start = time.perf_counter()
    prepared = prepare_corpus(
        files,
        Path(args.out),
        tokenizer.vocab_size,
        progress=False,
        tokenizer=tokenizer,
        workers=args.workers,
    )
    seconds = time.perf_counter() - start
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    print(
        json.dumps(
            {
                "seconds": seconds,
                "cpu": own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime,
                "tokens": prepared.num_tokens,
                "docs": prepared.num_docs,
                "bytes": sum(f.stat().st_size for f in files),
                "rss_parent": own.ru_maxrss * 1024,
                "rss_worker": children.ru_maxrss * 1024,
                "digest": _digest(prepared.data_prefix),
            }
        )
    )


def _digest(prefix: Path) -> str:
    digest = hashlib.sha256()
    for suffix in (".bin", ".idx", ".json"):
        with open(f"{prefix}{suffix}", "rb") as handle:
            while block := handle.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


def _spin(seconds: list) -> None:
    start, x = time.perf_counter(), 0
    # ~0.5 s: long against the fork and join it is timed with (0.1 s read 1.35 idle)
    for i in range(15_000_000):
        x += i
    seconds.append(time.perf_counter() - start)


def parallel_capacity(workers: int) -> float:
    """How many cores this machine gives `workers` pure-CPU processes right now (N on an idle machine): the
    yardstick for the speed-up, since another job on a shared machine takes cores the workers would use."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    start = time.perf_counter()
    _spin([])
    alone = time.perf_counter() - start
    procs = [ctx.Process(target=_spin, args=([],)) for _ in range(workers)]
    start = time.perf_counter()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return workers * alone / (time.perf_counter() - start)


def _arm(input_: str, tokenizer: Path, workers: int, out: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--arm",
        "--input",
        input_,
        "--tokenizer",
        str(tokenizer),
        "--workers",
        str(workers),
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"arm {input_} x{workers} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _best_of(
    repeats: int, input_: str, tokenizer: Path, workers: int, out: Path
) -> dict[int, dict]:
    """Alternate the arms `repeats` times (1, N, 1, N, ...) and keep each one's fastest run (a shared machine's
    other load only ever slows a run down) and its highest peak RSS."""
    best: dict[int, dict] = {}
    for r in range(repeats):
        for w in (1, workers):
            arm = _arm(input_, tokenizer, w, out / f"{r}-{w}")
            seen = best.setdefault(w, arm)
            for key in ("rss_parent", "rss_worker"):
                seen[key] = max(seen[key], arm[key])
            if arm["seconds"] < seen["seconds"]:
                seen.update(seconds=arm["seconds"], cpu=arm["cpu"])
            if arm["digest"] != seen["digest"]:
                seen["digest"] = "differs between repeats"
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size-mb", type=float, default=1000, help="generated JSON-lines size (MB)"
    )
    parser.add_argument(
        "--fixed-mb", type=float, default=20, help="the small file that measures fixed memory"
    )
    parser.add_argument("--workers", type=int, default=0, help="the N arm (default: every core)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument(
        "--repeats", type=int, default=3, help="alternating runs per arm; the fastest counts"
    )
    parser.add_argument(
        "--cache-dir", default="~/.cache/keel", help="where the default corpus's tokenizer is"
    )
    parser.add_argument("--arm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        return run_arm(args)

    from keel.data import ensure_prepared
    from keel.data.tokenize_pool import default_workers

    workers = args.workers or default_workers()
    tokenizer = ensure_prepared(["default"], args.cache_dir, args.vocab_size).tokenizer_path
    print(
        f"cores available: {default_workers()} | N = {workers} workers | tokenizer {tokenizer} "
        f"(threads pinned to 1) | cpu: {_cpu_name()} | load average {os.getloadavg()[0]:.1f} at start",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="keel-bench-prepare-") as tmp:
        root = Path(tmp)
        big, small = root / "big.jsonl", root / "small.jsonl"
        t = time.perf_counter()
        generate_jsonl(big, args.size_mb)
        generate_jsonl(small, args.fixed_mb, seed=1)
        print(
            f"generated {big.stat().st_size / MB:.0f} MB of JSON lines in {time.perf_counter() - t:.1f} s",
            flush=True,
        )
        fixed = {w: _arm(str(small), tokenizer, w, root / f"fixed{w}") for w in (1, workers)}
        for name, input_ in (
            ("default corpus", "default"),
            (f"jsonl {args.size_mb:g} MB", str(big)),
        ):
            before = parallel_capacity(workers)
            arms = _best_of(args.repeats, input_, tokenizer, workers, root / str(len(rows)))
            free = min(before, after := parallel_capacity(workers))
            rows.append((name, arms))
            _print_rows(name, arms, fixed, workers, check_memory=input_ != "default", free=free)
            print(
                f"cores free for {workers} CPU-bound processes: {before:.2f} before, {after:.2f} after (an idle "
                f"machine gives {workers}; below {0.9 * workers:.1f} the speed-up is inconclusive)",
                flush=True,
            )
    print()
    print(
        f"speed-up target >= 1.7x at 2 workers on 2 cores; memory target: peak <= fixed + {BYTES_PER_DOC} B/doc "
        f"(fixed = the same arm on a {args.fixed_mb:g} MB file)"
    )


def _print_rows(
    name: str,
    arms: dict[int, dict],
    fixed: dict[int, dict],
    workers: int,
    check_memory: bool,
    free: float,
) -> None:
    one = arms[1]
    print(
        f"\n{name}: {one['bytes'] / MB:.1f} MB, {one['docs']:,} documents, {one['tokens']:,} tokens"
    )
    print(
        f"{'workers':>7} {'seconds':>8} {'cpu s':>7} {'tokens/s':>11} {'speed-up':>8} {'identical':>9} "
        f"{'rss MB':>7} {'fixed+12B/doc':>13} {'worker rss':>10} {'fixed+12B/doc':>13} verdict"
    )
    for w, arm in sorted(arms.items()):
        speed_up = one["seconds"] / arm["seconds"]
        same = arm["digest"] == one["digest"]
        limit_parent = fixed[w]["rss_parent"] + BYTES_PER_DOC * arm["docs"]
        limit_worker = fixed[w]["rss_worker"] + BYTES_PER_DOC * arm["docs"]
        # the default corpus's documents are whole files (up to 0.75 MB): the encoding process's peak follows the
        # largest one, not the corpus size, so only the generated file is held to the per-document target
        ok_mem = not check_memory or (
            arm["rss_parent"] <= limit_parent and (w == 1 or arm["rss_worker"] <= limit_worker)
        )
        if w == 1 or workers != 2:
            speed = "-"
        elif free < 0.9 * workers:  # another job holds the cores the workers would use
            speed = "inconclusive"
        else:
            speed = "PASS" if speed_up >= 1.7 else "FAIL"
        verdict = (
            f"identical:{'PASS' if same else 'FAIL'} memory:{'PASS' if ok_mem else 'FAIL'}"
            + (f" speed:{speed}" if w > 1 else "")
        )
        limits = (
            (f"{limit_parent / MB:13.0f}", f"{limit_worker / MB:13.0f}")
            if check_memory
            else (f"{'n/a':>13}",) * 2
        )
        worker_rss = (
            f"{arm['rss_worker'] / MB:10.0f} {limits[1]}" if w > 1 else f"{'-':>10} {'-':>13}"
        )
        rate = arm["tokens"] / arm["seconds"]
        print(
            f"{w:>7} {arm['seconds']:8.2f} {arm['cpu']:7.1f} {rate:11,.0f} {speed_up:7.2f}x "
            f"{'yes' if same else 'NO':>9} {arm['rss_parent'] / MB:7.0f} {limits[0]} {worker_rss} "
            f"{verdict}",
            flush=True,
        )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
