"""Per-rank activation memory under context parallelism, measured as peak RSS on CPU, against Keel's memory model.

Usage: python bench/cp_memory.py [--seq 8192,16384,32768] [--cp 1,2,4] [--micro-batch 1] [--layers N] [--heap mmap]

For each (sequence length, cp) a fresh gloo world of cp ranks builds the default model (fp32, `keel train`'s
defaults), runs one training forward and backward of one micro-batch, and reports each rank's peak resident memory
above its resident memory just before the forward (ru_maxrss, so a fresh process per point: the peak only
grows). The model's figure is `activation_peak` for the same layout (keel/engine/memory_model.py: the blocks'
saved activations, the head, and the ring's in-flight buffers). Printed per point: measured and modelled MiB per
rank, their ratio, and the measured share of the cp=1 figure at that sequence length (1/cp is the target).

`--heap mmap` starts the ranks with glibc's MALLOC_MMAP_THRESHOLD_=65536, so every block of 64 KiB or more is its
own mapping, returned on free: the peak is then the live bytes, not the heap's holes. Under the default heap the
ring's many block-sized temporaries, freed between the saved activations, leave holes that a long sequence's
later, larger allocations cannot reuse, and the peak grows with the layer count.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
from dataclasses import replace

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from keel.config import RunConfig
from keel.engine.memory_model import Layout, activation_peak
from keel.model import CausalLM
from keel.parallel import comm
from keel.parallel.layer_parallel import LayerParallel
from keel.parallel.topology import Topology

MIB = 2**20


def run_config(seq_len: int, cp: int, micro_batch: int, layers: int = 0) -> RunConfig:
    """`keel train`'s default model (`layers` blocks if > 0) at `seq_len`, on cp ranks."""
    cfg = RunConfig()
    model = replace(cfg.model, vocab_size=cfg.data.tokenizer_vocab_size, compile="false")
    model = replace(model, n_layers=layers or model.n_layers)
    return replace(
        cfg,
        model=model,
        data=replace(cfg.data, seq_len=seq_len),
        parallel=replace(cfg.parallel, cp=cp),
        train=replace(cfg.train, micro_batch_size=micro_batch, global_batch_size=micro_batch),
    )


def _rank(
    rank: int, world: int, port: int, seq_len: int, micro_batch: int, layers: int, out
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        cfg = run_config(seq_len, world, micro_batch, layers)
        topology = Topology.from_env(cp=world)
        model = CausalLM(cfg.model, seed=0, parallel=LayerParallel.from_topology(topology))
        tokens = torch.randint(0, cfg.model.vocab_size, (micro_batch, seq_len + 1))
        warm = tokens[:, : 4 * world + 1]  # kernels and allocator warmed on a short sequence
        model(warm[:, :-1], warm[:, 1:]).backward()
        model.zero_grad(set_to_none=False)
        before = psutil.Process().memory_info().rss
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        rise = torch.tensor([float(peak - before)])
        comm.all_reduce(rise, topology.control("world"), op="max")
        if rank == 0:
            out.put(rise.item())
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(seq_len: int, cp: int, micro_batch: int, layers: int) -> float:
    """The largest per-rank peak RSS rise (bytes) of one forward and backward at `seq_len` over `cp` ranks."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _rank,
        args=(cp, _free_port(), seq_len, micro_batch, layers, queue),
        nprocs=cp,
        start_method="spawn",
    )
    return queue.get()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="8192,16384,32768")
    parser.add_argument("--cp", default="1,2,4")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument(
        "--layers", type=int, default=0, help="blocks (default: the default model's)"
    )
    parser.add_argument("--heap", choices=("default", "mmap"), default="default")
    args = parser.parse_args(argv)
    if args.heap == "mmap":  # read by glibc when each spawned rank starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    seqs = [int(s) for s in args.seq.split(",")]
    cps = [int(c) for c in args.cp.split(",")]
    cfg = run_config(seqs[0], 1, args.micro_batch, args.layers).model
    print(
        f"model: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads ({cfg.n_kv_heads} kv), vocab "
        f"{cfg.vocab_size}; fp32, micro-batch {args.micro_batch}; heap {args.heap}; torch {torch.__version__}"
    )
    print(
        "| seq | cp | measured MiB/rank | model MiB/rank | measured/model | share of cp=1 (target 1/cp) |"
    )
    print("|---|---|---|---|---|---|")
    for seq in seqs:
        base = None
        for cp in cps:
            measured = measure(seq, cp, args.micro_batch, args.layers)
            run = run_config(seq, cp, args.micro_batch, args.layers)
            model = activation_peak(run, Layout(cp=cp), "fp32")
            base = measured if cp == 1 else base
            share = f"{measured / base:.3f} (1/{cp} = {1 / cp:.3f})" if base else "n/a"
            print(
                f"| {seq} | {cp} | {measured / MIB:.0f} | {model / MIB:.0f} | {measured / model:.2f} | {share} |",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
