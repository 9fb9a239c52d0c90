"""`bench/throughput.py --ranks 2`: Keel's trainer step against HF + DeepSpeed on 2 gloo ranks.

Why a second reference: the plain HF loop of one process says what Keel's layers and engine cost against the
obvious loop; at 2 ranks the question is what Keel adds over DeepSpeed itself, so the reference is the same HF
Llama handed to `deepspeed.initialize` with the same DeepSpeed JSON (ZeRO stage, bucket sizes, overlap_comm,
precision), the same global batch and micro-batch split, `torch.optim.AdamW(foreach=True)` and Keel's LR schedule,
driven by the canonical DeepSpeed loop (forward, `engine.backward`, `engine.step` per micro-batch). Both engines
live in the same two processes and alternate step by step (throughput.PairedTrainer), so they share the machine.

Ranks are spawned as bench/memory.py spawns them (torch.multiprocessing, gloo), each with half the cores; the
matmul peak is measured on both ranks at once and summed, so MFU is global tokens/s against the machine's peak
under the same sharing. Rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from paired_step import (
    DTYPES,
    build_keel,
    describe,
    hf_model,
    matmul_peak,
    reference_batches,
    report,
)


def ds_step(trainer, hf) -> tuple[Callable[[int], float], object]:
    """The HF model under its own DeepSpeed engine, on the run's resolved JSON; one optimizer step per call."""
    import deepspeed

    from keel.engine.ds_config import resolve_ds_config
    from keel.engine.lr_schedule import build_scheduler
    from keel.model import causal_lm_loss
    from keel.run_dir import read_run_dir

    cfg, topo, t = trainer.cfg, trainer.topology, trainer.cfg.train
    ds = resolve_ds_config(read_run_dir(trainer.run_dir)[1], cfg, topo.dp_size)
    params = [p for p in hf.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay, foreach=True
    )
    engine, _, _, _ = deepspeed.initialize(
        model=hf,
        optimizer=optimizer,
        config=ds,
        lr_scheduler=lambda opt: build_scheduler(opt, t, dp=topo.dp_size),
    )
    batches = reference_batches(trainer)

    def step(i: int) -> float:
        micro = batches(i)
        total = 0.0
        for mb in micro:
            loss = causal_lm_loss(engine(input_ids=mb[:, :-1], use_cache=False).logits, mb[:, 1:])
            engine.backward(loss)
            engine.step()  # DeepSpeed applies the update at the accumulation boundary
            total = total + loss.detach().float() / len(micro)
        return float(total)  # this rank's loss; the data-parallel mean is taken once, after the run

    return step, engine


def _rank(rank: int, run_dir: str, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(args.ranks),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    from keel.engine.distributed import init_distributed, setup_logging
    from keel.model import num_params
    from keel.training.entry import exit_now

    init_distributed()
    setup_logging(rank)
    trainer, initial = build_keel(Path(run_dir))
    hf, n_params = hf_model(trainer, initial), num_params(initial)
    del initial
    step, ref_engine = ds_step(trainer, hf)
    trainer.pair(step, args.warmup, args.steps, args.profile_steps)
    device = trainer.engine.device
    peaks = {name: _summed_peak(dt, device) for name, dt in DTYPES.items()}
    trainer.fit()
    peaks = {name: max(peaks[name], _summed_peak(dt, device)) for name, dt in DTYPES.items()}
    # the reference's data-parallel mean losses (Keel's record already holds its own), in one all-reduce
    ref_losses = torch.tensor(trainer.ref.losses, dtype=torch.float64)
    dist.all_reduce(ref_losses)
    if rank == 0:
        header = describe(
            args,
            trainer,
            n_params,
            f"DeepSpeed {type(ref_engine.optimizer).__name__} over AdamW(foreach=True)",
        )
        report(
            trainer,
            "HF + DeepSpeed",
            peaks,
            args.precision,
            (ref_losses / args.ranks).tolist(),
            trainer.keel.losses,
            header,
        )
    dist.barrier()
    exit_now(0)  # gloo can abort in its destructors at interpreter exit


def _summed_peak(dtype: torch.dtype, device) -> tuple[float, int]:
    """Every rank measures at once (the sharing training sees); the machine's peak is their sum."""
    dist.barrier()
    flops, n = matmul_peak(dtype, device)
    total = torch.tensor([flops], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total), n


def launch(run_dir: Path, args: argparse.Namespace) -> None:
    """Spawn the ranks on this machine and wait for them."""
    import torch.multiprocessing as mp

    from keel.launcher.local import free_port

    mp.start_processes(
        _rank, args=(str(run_dir), args, free_port()), nprocs=args.ranks, start_method="spawn"
    )
