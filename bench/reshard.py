"""What spreading the universal conversion over ranks buys: a checkpoint of about `--size-mb` converted by one
rank (the other waits on rank 0's heartbeat) and by two, interleaved, in one 2-rank gloo world.

The checkpoint: a dense model trained one step under ZeRO-1 at dp=2 (fp32: each rank's optimizer file holds its
half of the master weights and both AdamW moments; the model-states file the weights), saved by DeepSpeed. Each
repeat converts it with converters [0] and [0, 1] (the order alternating between repeats, so drift on a shared
host hits both), through `keel.training.checkpoint.reshard.Conversion` — what a resume on another layout runs —
into the tag's `universal/`, removed after each. Page cache: the checkpoint was just written and fits in memory,
so both modes read it from the cache (a cold shared filesystem would make the split matter more, not less).

Prints each mode's conversion wall time on rank 0 (its median over repeats) and the ratio one / two ranks, with
where rank 0's time went: before its first item (DeepSpeed's converter reads every model-states file to learn the
layout, on every converter), its share of the items, and after its last one (the lead's rest). On 2 cores the
ceiling is 2x less the parts that do not split: the model-states pass every converter makes, and the lead's rest
(the optimizer's common state, the file copies).

    python bench/reshard.py [--size-mb 1300] [--repeats 3]
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
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from keel.config import ModelConfig, RunConfig, TrainConfig  # noqa: E402
from keel.launcher.local import free_port  # noqa: E402

SEQ, MICRO, VOCAB, DIM = 32, 1, 8192, 1024


def build(size_mb: float):
    from keel.engine.build import build_engine
    from keel.parallel.topology import Topology

    # 16 bytes/param over the whole checkpoint: fp32 weights (model states) + master copy and 2 moments (ZeRO-1)
    per_layer, embed = 12 * DIM * DIM, 2 * VOCAB * DIM
    layers = max(1, round((size_mb * 2**20 / 16 - embed) / per_layer))
    cfg = RunConfig(
        model=ModelConfig(
            vocab_size=VOCAB,
            dim=DIM,
            n_layers=layers,
            n_heads=16,
            n_kv_heads=8,
            vocab_pad_multiple=1,
            compile="false",
        ),
        train=TrainConfig(
            global_batch_size=2 * MICRO, micro_batch_size=MICRO, lr=1e-4, warmup_steps=0
        ),
    )
    ds = json.loads((REPO / "ds_configs" / "zero1.json").read_text())
    return build_engine(cfg, ds, Topology.from_env())


def worker(rank: int, port: int, root: str, size_mb: float, repeats: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )
    from keel.engine.distributed import init_distributed
    from keel.parallel import comm
    from keel.parallel.topology import Topology
    from keel.run_dir import UNIVERSAL
    from keel.training.checkpoint import reshard
    from keel.training.checkpoint.store import Checkpointer

    init_distributed()
    engine = build(size_mb)
    batch = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()
    directory = Path(root) / "checkpoints"
    engine.save_checkpoint(str(directory), tag="step1")
    topology = Topology.from_env()
    world = comm.world_control()
    comm.barrier(world)
    tag_dir = directory / "step1"
    nbytes = sum(p.stat().st_size for p in tag_dir.iterdir() if p.is_file())
    times: dict[int, list[float]] = {1: [], 2: []}
    parts: dict[int, list[list[float]]] = {
        1: [],
        2: [],
    }  # rank 0: before its first item, items, after
    for repeat in range(repeats):
        for n in (1, 2) if repeat % 2 == 0 else (2, 1):
            checkpointer = Checkpointer(directory, 2, topology)
            conversion = reshard.Conversion(checkpointer, "step1", {}, 0, most=n)
            marks = []
            start = time.monotonic()
            seconds = conversion.run(topology, lambda marks=marks: marks.append(time.monotonic()))
            comm.barrier(world)
            if rank == 0:
                times[n].append(seconds)
                parts[n].append(
                    [marks[0] - start, marks[-1] - marks[0], start + seconds - marks[-1]]
                )
                shutil.rmtree(tag_dir / UNIVERSAL)
                (directory / "latest_universal").unlink(missing_ok=True)
            comm.barrier(world)
    if rank == 0:
        result = {"bytes": nbytes, "times": times, "parts": parts}
        (Path(root) / "result.json").write_text(json.dumps(result))
    comm.barrier(world)
    os._exit(0)  # gloo can abort at interpreter exit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="keel-reshard-"))
    try:
        mp.start_processes(
            worker,
            args=(free_port(), str(root), args.size_mb, args.repeats),
            nprocs=2,
            start_method="spawn",
        )
        result = json.loads((root / "result.json").read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    one, two = (statistics.median(result["times"][k]) for k in ("1", "2"))
    print(f"checkpoint: {result['bytes'] / 2**30:.2f} GiB (ZeRO-1, dp 2, fp32)")
    for k, label in (("1", "1 rank "), ("2", "2 ranks")):
        runs = ", ".join(f"{t:.1f}" for t in result["times"][k])
        print(
            f"conversion on {label}: median {statistics.median(result['times'][k]):.1f} s ({runs})"
        )
    print(f"speed-up 1 -> 2 ranks: {one / two:.2f}x")
    print(
        "rank 0's time, median: before its first item (DeepSpeed reads every model-states file) | its items"
    )
    print("(extract, merge) | after its last (the lead's rest, waiting for the other converter):")
    for k in ("1", "2"):
        before, items, after = (
            statistics.median(p[i] for p in result["parts"][k]) for i in range(3)
        )
        print(f"  {k} converter(s): {before:.1f} s | {items:.1f} s | {after:.1f} s")


if __name__ == "__main__":
    main()
