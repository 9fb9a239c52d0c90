"""Keel's whole trainer step against Hugging Face references: tokens/s, MFU and the time outside the GEMMs.

Why: a tokens/s figure means little on its own. This script puts yardsticks next to it, all measured in the same
run on the same machine and thread count, so no number here is ever hard-coded:

* the peak: the best large square matmul rate (fp32 and bf16), which gives MFU = flops_per_token · tokens/s / peak,
  with flops_per_token = 6·N + 12·L·d·T (PaLM, Chowdhery et al. 2022, appendix B; `keel.model.flops_per_token`);
* the reference: the same model as `transformers.LlamaForCausalLM(attn_implementation="sdpa")` with
  `torch.optim.AdamW(foreach=True)` and no activation checkpointing — one process: a plain loop
  (this file); `--ranks 2`: the same HF model under `deepspeed.initialize` with the same DeepSpeed JSON, ZeRO stage
  and global batch on 2 gloo ranks (bench/throughput_ranks.py);
* the time outside matmul and attention kernels: torch.profiler's self CPU time of every op except the GEMMs
  (mm/bmm/addmm/matmul/linear and their autograd nodes) and scaled_dot_product_attention (and its backward),
  per step — what Python, the engine, guards, metrics and data cost around the kernels (target Keel/ref <= 0.5).

Keel's side is its real trainer (keel/training/trainer.py, built as keel/training/entry.py builds it, from a run
dir written by `keel train`'s own code): a whole loop iteration — data from a prepared corpus through the
prefetcher, forward/backward/step, the guards at their defaults (the per-step ones; the periodic checks run every
50 steps, past a short run), metrics.jsonl, TensorBoard — timed from one `train_step` call to the next. The
reference runs at the top of each `train_step` call (`PairedTrainer`), reading the same samples with the same
`step_batch`, so the two alternate step by step (A/B pairs) and machine load hits both alike. Ratios are medians
of per-pair ratios, printed with their spread; when it is wide the machine was noisy, so rerun. Both start from
the same weights (`to_hf_state_dict`); the first-step losses are printed side by side as the proof.

Precision (one process). `--precision bf16` sets `bf16.enabled` in the DeepSpeed JSON; the plain HF loop mirrors
DeepSpeed by hand: bf16 model, fp32 master copies for clipping and AdamW. On a CPU without native bf16 (AVX2 only)
bf16 matmuls run tens of times slower than fp32; try it with small shapes or few pairs.

    python bench/throughput.py [--precision bf16] [--compile]            # 1 process, d256 L4 seq256
    python bench/throughput.py --ranks 2 --zero 2 [--overlap-comm on]    # 2 ranks vs HF + DeepSpeed, d512 L8 seq512
    python bench/throughput.py [--ranks 2] --dim 128 --layers 2 --seq-len 128 --steps 3 --warmup 1  # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from paired_step import (  # noqa: E402
    DTYPES,
    PairedTrainer,
    build_keel,
    describe,
    hf_model,
    matmul_peak,
    reference_batches,
    report,
)

# shape defaults per mode: (dim, layers, seq_len, micro_batch)
SHAPES = {1: (256, 4, 256, 4), 2: (512, 8, 512, 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--ranks",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: Keel vs a plain HF loop in this process; 2: Keel vs HF + DeepSpeed on 2 gloo ranks",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        help="ds_configs/zeroN.json (default: 0, 1 for 2 ranks)",
    )
    p.add_argument(
        "--ds-config",
        help="DeepSpeed JSON (overrides --zero); its bf16.enabled is set from --precision",
    )
    p.add_argument(
        "--overlap-comm",
        choices=("on", "off"),
        help="set zero_optimization.overlap_comm in the JSON",
    )
    p.add_argument("--dim", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument(
        "--vocab", type=int, default=4096, help="model vocabulary (the tokenizer's is at most 4096)"
    )
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batch", type=int)
    p.add_argument(
        "--global-batch", type=int, help="default: micro-batch x ranks (no accumulation)"
    )
    p.add_argument(
        "--steps", "--pairs", type=int, default=12, help="timed A/B pairs (>= 10 for a real figure)"
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed pairs before timing")
    p.add_argument(
        "--profile-steps", type=int, default=3, help="profiled pairs after the timed ones (0: none)"
    )
    p.add_argument("--precision", choices=sorted(DTYPES), default="fp32")
    p.add_argument(
        "--corpus",
        default="default",
        help="comma-separated files/globs (relative: to the stdlib), or 'default' as `keel train`",
    )
    p.add_argument(
        "--cache-dir", default="~/.cache/keel", help="prepared-corpus cache (data.cache_dir)"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--compile",
        action="store_true",
        help="Keel with model.compile (each block torch.compile'd); "
        "the first step's time, compilation included, is printed",
    )
    p.add_argument(
        "--kernels", default="auto", choices=["auto", "torch", "liger"], help="Keel's model.kernels"
    )
    args = p.parse_args(argv)
    dim, layers, seq, micro = SHAPES[args.ranks]
    args.dim, args.layers = args.dim or dim, args.layers or layers
    args.seq_len, args.micro_batch = args.seq_len or seq, args.micro_batch or micro
    args.global_batch = args.global_batch or args.micro_batch * args.ranks
    zero = args.zero if args.zero is not None else min(1, args.ranks - 1)
    args.ds_config = args.ds_config or str(REPO / "ds_configs" / f"zero{zero}.json")
    return args


def corpus_spec(text: str) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [
        e if e == "default" or Path(e).is_absolute() else str(stdlib / e) for e in text.split(",")
    ]


def patched_ds(raw: dict, args: argparse.Namespace) -> dict:
    """The JSON with --precision (bf16 on/off, fp16 off) and --overlap-comm applied."""
    ds = {**raw, "bf16": {**raw.get("bf16", {}), "enabled": args.precision == "bf16"}}
    if "fp16" in ds:
        ds["fp16"] = {**ds["fp16"], "enabled": False}
    if args.overlap_comm:
        ds["zero_optimization"] = {
            **ds.get("zero_optimization", {}),
            "overlap_comm": args.overlap_comm == "on",
        }
    return ds


def write_run(args: argparse.Namespace, run_dir: Path) -> Path:
    """A `keel train` run dir (config, DeepSpeed JSON, prepared data) made by Keel's own launcher code."""
    from keel.launcher.run_spec import build_run, prepare_data, write_run_dir

    sets = {
        "model.dim": args.dim,
        "model.n_layers": args.layers,
        "model.n_heads": args.heads,
        "model.n_kv_heads": args.kv_heads,
        "model.vocab_size": args.vocab,
        "model.compile": str(args.compile),
        "model.kernels": args.kernels,
        "data.seq_len": args.seq_len,
        "data.tokenizer_vocab_size": min(args.vocab, 4096),
        "data.corpus": json.dumps(corpus_spec(args.corpus)),
        "data.cache_dir": args.cache_dir,
        # one trailing step closes the last timed Keel iteration (and holds the final checkpoint save)
        "train.steps": args.warmup + args.steps + args.profile_steps + 1,
        "train.seed": args.seed,
        "train.global_batch_size": args.global_batch,
        "train.micro_batch_size": args.micro_batch,
        "train.lr_schedule": "constant",
        "train.warmup_steps": 0,
        "train.eval_interval": 0,
        "checkpoint.interval": 0,
        "checkpoint.resume": "false",
    }
    spec = build_run(
        None, [f"{k}={v}" for k, v in sets.items()], args.ds_config, str(run_dir), args.ranks
    )
    spec.ds_raw = patched_ds(spec.ds_raw, args)
    prepare_data(spec)
    write_run_dir(spec)
    return spec.run_dir


def hf_step(trainer: PairedTrainer, hf, dtype: torch.dtype) -> Callable[[int], float]:
    """The plain loop: forward, fp32 cross-entropy, backward, clip, AdamW (on fp32 masters when `dtype` is bf16)."""
    from keel.engine.lr_schedule import build_scheduler
    from keel.model import causal_lm_loss

    t = trainer.cfg.train
    # parameters only: HF's RoPE inv_freq stays fp32, as Keel's tables are computed in fp32
    with torch.no_grad():
        for p in hf.parameters():
            p.data = p.data.to(dtype)
    params = [p for p in hf.parameters() if p.requires_grad]  # a tied weight appears once
    masters = params if dtype == torch.float32 else [p.detach().float().clone() for p in params]
    groups = [
        {"params": [m for m in masters if m.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [m for m in masters if m.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay, foreach=True
    )
    scheduler = build_scheduler(optimizer, t)
    batches = reference_batches(trainer)

    def step(i: int) -> float:
        micro = batches(i)
        total = 0.0
        for mb in micro:  # HF's own `labels=` loss shifts them again; these are shifted already
            loss = causal_lm_loss(
                hf(input_ids=mb[:, :-1], use_cache=False).logits, mb[:, 1:]
            ) / len(micro)
            loss.backward()
            total = total + loss.detach()
        if masters is not params:
            for p, m in zip(params, masters):
                m.grad, p.grad = p.grad.float(), None
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(masters, t.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if masters is not params:
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        return float(total)

    return step


def single_process_env() -> None:
    """What a launcher would export for a world of one; values already set are kept."""
    from keel.launcher.local import free_port

    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
    ):
        os.environ.setdefault(key, value)


def run_single(args: argparse.Namespace, run_dir: Path) -> None:
    """Keel's trainer and the plain HF loop in this process, a world of one."""
    single_process_env()
    from keel.engine.distributed import init_distributed, setup_logging
    from keel.model import num_params

    init_distributed()
    setup_logging(0)
    trainer, initial = build_keel(run_dir)
    hf, n_params = hf_model(trainer, initial), num_params(initial)
    del initial
    trainer.pair(
        hf_step(trainer, hf, DTYPES[args.precision]), args.warmup, args.steps, args.profile_steps
    )
    engine = trainer.engine
    header = describe(args, trainer, n_params, "AdamW(foreach=True)") + f" | keel from {REPO}"
    # peak = best rate seen; measured before and after training, as load from other tenants only ever slows it
    peaks = {name: matmul_peak(dt, engine.device) for name, dt in DTYPES.items()}
    trainer.fit()
    peaks = {name: max(peaks[name], matmul_peak(dt, engine.device)) for name, dt in DTYPES.items()}
    report(
        trainer,
        "HF Llama + AdamW",
        peaks,
        args.precision,
        trainer.ref.losses,
        trainer.keel.losses,
        header,
    )


def main() -> None:
    from keel.training.entry import exit_now

    args = parse_args()
    # the run dir: config, metrics, the final checkpoint
    tmp = Path(tempfile.mkdtemp(prefix="keel-throughput-"))
    try:
        run_dir = write_run(args, tmp / "run")
        if args.ranks > 1:
            from throughput_ranks import launch

            launch(run_dir, args)
        else:
            run_single(args, run_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    exit_now(0)  # gloo can abort in its destructors at interpreter exit


if __name__ == "__main__":
    main()
