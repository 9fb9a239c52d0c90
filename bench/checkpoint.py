"""What an asynchronous checkpoint (`checkpoint.async_save`) costs, against a synchronous one, in one process.

One rank (world size 1, gloo), a model whose checkpoint is about `--size-mb` (fp32, ZeRO-0: weights plus both
AdamW moments in `mp_rank_00_model_states.pt`), seq 32, micro-batch 1 (short steps: the saves are measured, and
step-time noise on a shared host grows with the step). Each repeat trains `--steps` steps twice
from the same engine, once saving synchronously (Keel's `Checkpointer.save`) and once asynchronously
(`AsyncCheckpointer`: the trainer's calls, `poll` after every step), every `--interval` steps; the two modes
alternate inside each repeat (sync first in even repeats, async first in odd ones), so machine noise hits both.

Prints:
(a) save throughput: the checkpoint's bytes over the background writer's wall time (write aside and sha256,
    fsync, rename) for the final save, which the end of the run waits for (the writer alone: a measure of the write
    path), against the disk's write bandwidth measured with fsync in the same run (the same number of bytes
    written in 8 MiB blocks, then fsync), ratio target >= 0.70. Also the throughput of torch.save into the page
    cache (no fsync, no hash: what serialization alone allows on this CPU), and the writer's throughput while
    training runs.
(b) the extra wall time over the steps spanning a save: the save call plus, over the steps that follow it while
    the writer runs (at least the first half of the interval), each step's time minus the median of the later
    steps before the next save (neighbours, so this host's drifting step time cancels); summed over the saves
    followed by steps, async / sync, target <= 0.25. With it, what bounds it: the save call (sync: the whole
    save; async: the snapshot) and the writer's CPU time. The final save, which the run waits for (async: its
    whole write, fsync included), is printed apart.

    python bench/checkpoint.py [--steps 30] [--interval 10] [--repeats 3] [--size-mb 200]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from keel.config import ModelConfig, RunConfig, TrainConfig  # noqa: E402
from keel.launcher.local import free_port  # noqa: E402
from keel.parallel.topology import Topology  # noqa: E402
from keel.training.checkpoint.async_save import AsyncCheckpointer  # noqa: E402
from keel.training.checkpoint.store import Checkpointer, TrainState  # noqa: E402

SEQ, MICRO, VOCAB = 32, 1, 8192  # short steps: the saves, not the model, are measured


def build(size_mb: float):
    from keel.engine.build import build_engine

    dim, layers = 512, 1
    per_layer, embed = (
        12 * dim * dim,
        VOCAB * dim,
    )  # attention (GQA ~ 3d²) + SwiGLU (~8d²) + norms, roughly
    # 12 bytes/param: weight + 2 moments
    layers = max(1, round((size_mb * 2**20 / 12 - embed) / per_layer))
    cfg = RunConfig(
        model=ModelConfig(
            vocab_size=VOCAB,
            dim=dim,
            n_layers=layers,
            n_heads=8,
            n_kv_heads=4,
            vocab_pad_multiple=1,
            compile="false",
        ),
        train=TrainConfig(global_batch_size=MICRO, micro_batch_size=MICRO, lr=1e-4, warmup_steps=0),
    )
    ds = json.loads((REPO / "ds_configs" / "zero0.json").read_text())
    return build_engine(cfg, ds, Topology.from_env())


def train_step(engine, generator: torch.Generator) -> None:
    batch = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=generator)
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()


def disk_bandwidth(directory: Path, nbytes: int) -> float:
    """Bytes/s of plain sequential writes of `nbytes` followed by fsync (the bound any checkpoint writer has)."""
    block = os.urandom(8 << 20)
    path = directory / "bandwidth.bin"
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    written = path.stat().st_size
    path.unlink()
    return written / seconds


def run_mode(
    engine, checkpointer: Checkpointer, saver: AsyncCheckpointer | None, steps: int, interval: int
) -> dict:
    """One run of `steps` steps saving every `interval` (`saver`: asynchronously, kept across repeats like a run
    keeps it: its host buffers are allocated by the first save only)."""
    generator = torch.Generator().manual_seed(0)
    step_times, outcomes, save_calls, concluded_at = [], [], {}, {}
    for step in range(1, steps + 1):
        start = time.perf_counter()
        train_step(engine, generator)
        if saver is not None:
            for outcome in saver.poll():
                outcomes.append(outcome)
                concluded_at[outcome.step] = step
        step_times.append(time.perf_counter() - start)
        if step % interval == 0:
            start = time.perf_counter()
            (saver or checkpointer).save(engine, TrainState(step=step))
            save_calls[step] = time.perf_counter() - start
    final = time.perf_counter()
    if saver is not None:
        outcomes += saver.poll(wait=True)
        assert all(o.ok for o in outcomes), outcomes
    final = time.perf_counter() - final + save_calls[max(save_calls)]
    extra, spanned = [], []
    for step in sorted(save_calls)[:-1]:  # saves followed by steps
        window = step_times[
            step : step + interval - 1
        ]  # the steps after the save, up to the next one
        # the writer's steps, or the first half
        span = max(interval // 2, concluded_at.get(step, step) - step)
        rest = window[span:] or step_times[: interval - 1]
        extra.append(save_calls[step] + sum(t - statistics.median(rest) for t in window[:span]))
        spanned.append(span)
    tag = checkpointer.latest_tag()
    size = sum(p.stat().st_size for p in (checkpointer.directory / tag).iterdir() if p.is_file())
    return {
        "extra": extra,
        "final": final,
        "ordinary": statistics.median(step_times[: interval - 1]),
        "bytes": size,
        "save_calls": list(save_calls.values()),
        "spanned": spanned,
        "writes": [o.nbytes / o.write_seconds for o in outcomes],
        "write_cpu": [o.write_cpu_seconds for o in outcomes] if saver is not None else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size-mb", type=float, default=200)
    parser.add_argument(
        "--dir", default="", help="where checkpoints go (default: a temporary directory)"
    )
    args = parser.parse_args()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    from keel.engine.distributed import init_distributed

    init_distributed()
    directory = Path(tempfile.mkdtemp(prefix="keel-bench-ckpt-", dir=args.dir or None))
    try:
        engine = build(args.size_mb)
        n_params = sum(p.numel() for p in engine.module.parameters())
        results: dict[str, list[dict]] = {"sync": [], "async": []}
        bandwidths, serialize = [], []
        topology = Topology.from_env()
        checkpointers = {
            mode: Checkpointer(directory / mode, keep_last=1, topology=topology)
            for mode in ("sync", "async")
        }
        saver = AsyncCheckpointer(checkpointers["async"], pin=False)
        warmup = torch.Generator().manual_seed(1)
        # first steps (allocations) and first saves (the snapshot's buffers) are not measured
        for _ in range(3):
            train_step(engine, warmup)
        checkpointers["sync"].save(engine, TrainState(step=0))
        saver.save(engine, TrainState(step=0))
        saver.poll(wait=True)
        for repeat in range(args.repeats):
            for mode in ("sync", "async") if repeat % 2 == 0 else ("async", "sync"):
                results[mode].append(
                    run_mode(
                        engine,
                        checkpointers[mode],
                        saver if mode == "async" else None,
                        args.steps,
                        args.interval,
                    )
                )
            size = results["sync"][-1]["bytes"]
            bandwidths.append(disk_bandwidth(directory, size))
            serialize.append(_page_cache_save(engine, directory))
        report(args, n_params, results, bandwidths, serialize)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    os._exit(0)  # gloo can abort at interpreter exit


def _page_cache_save(engine, directory: Path) -> float:
    """Bytes/s of torch.save of the same state into the page cache: serialization (pickling, CRC32) alone."""
    state = {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}
    path = directory / "serialize.pt"
    start = time.perf_counter()
    torch.save(state, path)
    seconds = time.perf_counter() - start
    size = path.stat().st_size
    path.unlink()
    return size / seconds


def report(
    args, n_params: int, results: dict, bandwidths: list[float], serialize: list[float]
) -> None:
    size = results["sync"][0]["bytes"]
    mb = 2**20
    print(
        f"model: {n_params / 1e6:.1f}M params, checkpoint {size / mb:.0f} MiB; {args.steps} steps, a save every "
        f"{args.interval}, {args.repeats} repeat(s), modes interleaved; torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    final = [
        r["writes"][-1] for r in results["async"]
    ]  # the end of the run waits for it: the writer alone
    background = [
        w for r in results["async"] for w in r["writes"][:-1]
    ]  # written while training ran
    disk = statistics.median(bandwidths)
    print(
        f"(a) disk write bandwidth with fsync: {disk / mb:.0f} MiB/s (per repeat: "
        f"{', '.join(f'{b / mb:.0f}' for b in bandwidths)}); torch.save to the page cache: "
        f"{statistics.median(serialize) / mb:.0f} MiB/s (per repeat: "
        f"{', '.join(f'{b / mb:.0f}' for b in serialize)})"
    )
    print(
        f"    save throughput, the writer alone (the final save; write aside + sha256 + fsync + rename): median "
        f"{statistics.median(final) / mb:.0f} MiB/s (each: {', '.join(f'{w / mb:.0f}' for w in final)}) "
        f"-> {statistics.median(final) / disk:.2f} of the disk (target >= 0.70)"
    )
    if background:
        print(
            f"    while training runs: median {statistics.median(background) / mb:.0f} MiB/s "
            f"(each: {', '.join(f'{w / mb:.0f}' for w in background)})"
        )
    for mode in ("sync", "async"):
        extra = [e for r in results[mode] for e in r["extra"]]
        calls = [c for r in results[mode] for c in r["save_calls"]]
        cpu = [c for r in results[mode] for c in r["write_cpu"]]
        writer = (
            f"; the writer thread's CPU time per save {statistics.mean(cpu):.3f} s" if cpu else ""
        )
        print(
            f"    {mode:5s}: ordinary step {statistics.median(r['ordinary'] for r in results[mode]):.3f} s; extra "
            f"wall time per save {statistics.mean(extra):.3f} s (each: {', '.join(f'{e:.2f}' for e in extra)}; "
            f"spanning {max(s for r in results[mode] for s in r['spanned'])} steps at most); the save call "
            f"{statistics.mean(calls):.3f} s{writer}; the final save (waited for) "
            f"{statistics.mean(r['final'] for r in results[mode]):.3f} s"
        )
    ratios = [sum(a["extra"]) / sum(s["extra"]) for a, s in zip(results["async"], results["sync"])]
    total = sum(e for r in results["async"] for e in r["extra"]) / sum(
        e for r in results["sync"] for e in r["extra"]
    )
    print(
        f"(b) extra wall time over the steps spanning a save (saves followed by steps), async / sync: {total:.2f} "
        f"(per repeat: {', '.join(f'{r:.2f}' for r in ratios)}; target <= 0.25)"
    )


if __name__ == "__main__":
    main()
