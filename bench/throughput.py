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
    python bench/throughput.py --dim 128 --layers 2 --seq-len 128 --steps 3 --warmup 1 --corpus 'json/*.py'  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from keel.training.trainer import Trainer  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# shape defaults per mode: (dim, layers, seq_len, micro_batch)
SHAPES = {1: (256, 4, 256, 4), 2: (512, 8, 512, 2)}
# GEMMs and attention, their autograd nodes included ("autograd::engine::evaluate_function: MmBackward0")
KERNELS = re.compile(r"(?:autograd::engine::evaluate_function: )?(?:aten::(?:mm|bmm|addmm|baddbmm|addbmm|matmul|"
                     r"linear|_?scaled_dot_product\w*|_flash_attention\w*|_efficient_attention\w*)|"
                     r"(?:Mm|Addmm|Bmm|Baddbmm|Addbmm)Backward\d*|ScaledDotProduct\w*Backward\d*)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, choices=(1, 2), default=1,
                   help="1: Keel vs a plain HF loop in this process; 2: Keel vs HF + DeepSpeed on 2 gloo ranks")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ds_configs/zeroN.json (default: 0, 1 for 2 ranks)")
    p.add_argument("--ds-config", help="DeepSpeed JSON (overrides --zero); its bf16.enabled is set from --precision")
    p.add_argument("--overlap-comm", choices=("on", "off"), help="set zero_optimization.overlap_comm in the JSON")
    p.add_argument("--dim", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096, help="model vocabulary (the tokenizer's is at most 4096)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--global-batch", type=int, help="default: micro-batch x ranks (no accumulation)")
    p.add_argument("--steps", "--pairs", type=int, default=12, help="timed A/B pairs (>= 10 for a real figure)")
    p.add_argument("--warmup", type=int, default=3, help="untimed pairs before timing")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled pairs after the timed ones (0: none)")
    p.add_argument("--precision", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--corpus", default="default",
                   help="comma-separated files/globs (relative: to the stdlib), or 'default' as `keel train`")
    p.add_argument("--cache-dir", default="~/.cache/keel", help="prepared-corpus cache (data.cache_dir)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compile", action="store_true", help="Keel with model.compile (each block torch.compile'd); "
                   "the first step's time, compilation included, is printed")
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
    return [e if e == "default" or Path(e).is_absolute() else str(stdlib / e) for e in text.split(",")]


def patched_ds(raw: dict, args: argparse.Namespace) -> dict:
    """The JSON with --precision (bf16 on/off, fp16 off) and --overlap-comm applied."""
    ds = {**raw, "bf16": {**raw.get("bf16", {}), "enabled": args.precision == "bf16"}}
    if "fp16" in ds:
        ds["fp16"] = {**ds["fp16"], "enabled": False}
    if args.overlap_comm:
        ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "overlap_comm": args.overlap_comm == "on"}
    return ds


def write_run(args: argparse.Namespace, run_dir: Path) -> Path:
    """A `keel train` run dir (config, DeepSpeed JSON, prepared data) made by Keel's own launcher code."""
    from keel.launcher.run_dir import build_run, prepare_data, write_run_dir

    sets = {"model.dim": args.dim, "model.n_layers": args.layers, "model.n_heads": args.heads,
            "model.n_kv_heads": args.kv_heads, "model.vocab_size": args.vocab, "model.compile": str(args.compile),
            "data.seq_len": args.seq_len, "data.tokenizer_vocab_size": min(args.vocab, 4096),
            "data.corpus": json.dumps(corpus_spec(args.corpus)), "data.cache_dir": args.cache_dir,
            # one trailing step closes the last timed Keel iteration (and holds the final checkpoint save)
            "train.steps": args.warmup + args.steps + args.profile_steps + 1, "train.seed": args.seed,
            "train.global_batch_size": args.global_batch, "train.micro_batch_size": args.micro_batch,
            "train.lr_schedule": "constant", "train.warmup_steps": 0, "train.eval_interval": 0,
            "checkpoint.interval": 0, "checkpoint.resume": "false"}
    spec = build_run(None, [f"{k}={v}" for k, v in sets.items()], args.ds_config, str(run_dir), args.ranks)
    spec.ds_raw = patched_ds(spec.ds_raw, args)
    prepare_data(spec)
    write_run_dir(spec)
    return spec.run_dir


def sync(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(dtype: torch.dtype, device: torch.device, budget_s: float = 1.0) -> tuple[float, int]:
    """Best FLOP/s of a square matmul over sizes 512..4096; stops growing once one product takes > budget_s / 4."""
    best, best_n = 0.0, 0
    for n in (512, 1024, 2048, 4096):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        a @ b  # warm-up: kernel selection, page faults
        sync(device)
        fastest, spent = float("inf"), 0.0
        while spent < budget_s / 2 or fastest == float("inf"):
            start = time.perf_counter()
            a @ b
            sync(device)
            elapsed = time.perf_counter() - start
            fastest, spent = min(fastest, elapsed), spent + elapsed
        if 2 * n**3 / fastest > best:
            best, best_n = 2 * n**3 / fastest, n
        if fastest > budget_s / 4:
            break
    return best, best_n


def self_cpu_split(prof) -> tuple[float, float]:
    """(seconds outside GEMM/attention kernels, seconds inside them): torch.profiler self CPU time, all threads."""
    outside = kernels = 0.0
    for event in prof.key_averages():
        if KERNELS.fullmatch(event.key):
            kernels += event.self_cpu_time_total
        else:
            outside += event.self_cpu_time_total
    return outside / 1e6, kernels / 1e6


def cpu_profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU])


@dataclass
class Side:
    """One contestant's record: losses, timed step seconds, warm-up seconds, profiled (outside, kernels, wall)."""

    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    warmup: list[float] = field(default_factory=list)
    profiled: list[tuple[float, float, float]] = field(default_factory=list)

    def add(self, phase: str, seconds: float, prof=None) -> None:
        if phase == "timed":
            self.times.append(seconds)
        elif phase == "warmup":
            self.warmup.append(seconds)
        elif prof is not None:
            self.profiled.append((*self_cpu_split(prof), seconds))


class PairedTrainer(Trainer):
    """Keel's trainer with a reference step run at the top of each `train_step` call.

    Keel's iteration k is timed from the end of the reference step inside `train_step` k to the start of
    `train_step` k+1: its whole loop body (fetch, step, guards, checks, metrics, sinks, watchdog). Nothing in the
    trainer changes; the loop is `Trainer.fit`.
    """

    def pair(self, reference: Callable[[int], float], warmup: int, timed: int, profiled: int) -> None:
        self.reference, self.phases = reference, ["warmup"] * warmup + ["timed"] * timed + ["profile"] * profiled
        self.keel, self.ref = Side(), Side()
        self._open: tuple[str, float, object] | None = None

    def train_step(self, state):
        device = self.engine.device
        sync(device)
        if self._open is not None:  # Keel's previous iteration ends here
            phase, start, prof = self._open
            elapsed = time.perf_counter() - start
            if prof is not None:
                prof.stop()
            self.keel.add(phase, elapsed, prof)
            self._open = None
        if state.step < len(self.phases):
            phase = self.phases[state.step]
            prof = cpu_profiler() if phase == "profile" else None
            if prof is not None:
                prof.start()
            start = time.perf_counter()
            self.ref.losses.append(self.reference(state.step))
            sync(device)
            elapsed = time.perf_counter() - start
            if prof is not None:
                prof.stop()
            self.ref.add(phase, elapsed, prof)
            prof = cpu_profiler() if phase == "profile" else None
            if prof is not None:
                prof.start()
            self._open = (phase, time.perf_counter(), prof)
        record, decision = super().train_step(state)
        self.keel.losses.append(record["loss"])
        return record, decision


def build_keel(run_dir: Path):
    """This rank's trainer and an fp32 CPU copy of its initial model, built as keel/training/entry.py builds them."""
    from keel.data import IndexedDataset, PackedSamples
    from keel.launcher.run_dir import read_run_dir
    from keel.parallel.random import data_parallel_seed
    from keel.parallel.topology import Topology
    from keel.training.checkpoint import seed_everything
    from keel.training.engine import LRScale, build_engine, build_model

    cfg, ds_raw, data = read_run_dir(run_dir)
    topology = Topology.from_env()
    seed_everything(data_parallel_seed(cfg.train.seed, topology))
    dataset = IndexedDataset(data["prefix"])
    train = PackedSamples(dataset, cfg.data.seq_len, "train", cfg.data.val_fraction)
    val = PackedSamples(dataset, cfg.data.seq_len, "val", cfg.data.val_fraction)
    initial = build_model(cfg)  # the same seed gives the engine's model the same weights
    lr_scale = LRScale()
    engine = build_engine(cfg, ds_raw, topology, lr_scale=lr_scale)
    return PairedTrainer(cfg, engine, topology, train, val, run_dir, lr_scale), initial


def hf_model(trainer: PairedTrainer, initial: torch.nn.Module):
    """The pinned reference model: HF Llama, SDPA attention, no activation checkpointing, Keel's initial weights."""
    from transformers import LlamaForCausalLM

    from keel.model import to_hf_config, to_hf_state_dict

    cfg = trainer.cfg
    hf_cfg = to_hf_config(cfg.model, max_position_embeddings=max(cfg.data.seq_len, 2048))
    hf_cfg.use_cache = False
    hf = LlamaForCausalLM(hf_cfg)
    hf.set_attn_implementation("sdpa")
    hf.load_state_dict(to_hf_state_dict(initial), strict=True)
    assert hf.config._attn_implementation == "sdpa", hf.config._attn_implementation
    assert not hf.is_gradient_checkpointing
    return hf.to(trainer.engine.device).train()


def reference_batches(trainer: PairedTrainer) -> Callable[[int], list[torch.Tensor]]:
    """Step i's micro-batches for this rank: the samples Keel's step i reads, through the same `step_batch`."""
    from keel.data import step_batch

    t, topo = trainer.cfg.train, trainer.topology

    def batches(i: int) -> list[torch.Tensor]:
        return [mb.to(trainer.engine.device) for mb in step_batch(trainer.order, trainer.train_samples,
                i * t.global_batch_size, t.global_batch_size, t.micro_batch_size, topo.dp_rank, topo.dp_size)]

    return batches


def hf_step(trainer: PairedTrainer, hf, dtype: torch.dtype) -> Callable[[int], float]:
    """The plain loop: forward, fp32 cross-entropy, backward, clip, AdamW (on fp32 masters when `dtype` is bf16)."""
    from keel.model import causal_lm_loss
    from keel.training.lr_schedule import build_scheduler

    t = trainer.cfg.train
    with torch.no_grad():  # parameters only: HF's RoPE inv_freq stays fp32, as Keel's tables are computed in fp32
        for p in hf.parameters():
            p.data = p.data.to(dtype)
    params = [p for p in hf.parameters() if p.requires_grad]  # a tied weight appears once
    masters = params if dtype == torch.float32 else [p.detach().float().clone() for p in params]
    groups = [{"params": [m for m in masters if m.ndim >= 2], "weight_decay": t.weight_decay},
              {"params": [m for m in masters if m.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay,
                                  foreach=True)
    scheduler = build_scheduler(optimizer, t)
    batches = reference_batches(trainer)

    def step(i: int) -> float:
        micro = batches(i)
        total = 0.0
        for mb in micro:  # HF's own `labels=` loss shifts them again; these are shifted already
            loss = causal_lm_loss(hf(input_ids=mb[:, :-1], use_cache=False).logits, mb[:, 1:]) / len(micro)
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


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"median {statistics.median(values):.3f} (IQR {q[0]:.3f}-{q[2]:.3f}, range {min(values):.3f}-" \
           f"{max(values):.3f}, {len(values)} pairs)"


def report(trainer: PairedTrainer, ref_name: str, peaks: dict[str, tuple[float, int]], precision: str,
           ref_losses: list[float], keel_losses: list[float], header: str) -> None:
    """The table and ratio lines; tokens are global (all ranks), peaks summed over ranks."""
    from keel.model import flops_per_token

    cfg, keel, ref = trainer.cfg, trainer.keel, trainer.ref
    fpt, tokens = flops_per_token(cfg.model, cfg.data.seq_len), cfg.train.global_batch_size * cfg.data.seq_len
    print(f"\n{header}")
    cols = ("tokens/s", "step ms", *(f"MFU {n}" for n in peaks), "out-kern ms", "kernels ms")
    print(f"{'':<20}" + "".join(f"{c:>13}" for c in cols))
    for name, side in (("Keel (trainer step)", keel), (ref_name, ref)):
        step_s = statistics.median(side.times)
        prof = [statistics.median(x[i] for x in side.profiled) * 1e3 if side.profiled else float("nan")
                for i in (0, 1)]
        cells = (f"{tokens / step_s:,.0f}", f"{step_s * 1e3:,.1f}",
                 *(f"{fpt * tokens / step_s / peak:.1%}" for peak, _ in peaks.values()), *(f"{v:,.1f}" for v in prof))
        print(f"{name:<20}" + "".join(f"{c:>13}" for c in cells))
    print(f"Keel/ref tokens/s: {spread([r / k for k, r in zip(keel.times, ref.times)])}; "
          f"total-time ratio {sum(ref.times) / sum(keel.times):.3f}")
    if keel.profiled:
        print(f"Keel/ref self CPU time outside GEMM/attention per step (target <= 0.5): "
              f"{spread([k[0] / r[0] for k, r in zip(keel.profiled, ref.profiled)])}; profiled wall ms Keel "
              f"{statistics.median(k[2] for k in keel.profiled) * 1e3:,.1f}, ref "
              f"{statistics.median(r[2] for r in ref.profiled) * 1e3:,.1f}")
    for name, (flops, n) in peaks.items():
        marker = "  <- MFU of this run" if name == precision else ""
        print(f"peak {name} matmul: {flops / 1e12:.4f} TFLOP/s ({n}x{n}, best of repeats, summed over ranks){marker}")
    print(f"MFU = flops_per_token x tokens/s / peak; flops_per_token = 6N + 12*L*d*T = {fpt / 1e6:.2f} MFLOP "
          "(PaLM appendix B, no causal-mask discount); out-kern = profiler self CPU outside GEMM/SDPA")
    if keel.warmup and cfg.model.compile:
        print(f"model.compile: Keel's first step took {keel.warmup[0]:.1f} s (compilation included)")
    print(f"first-step loss: Keel {keel_losses[0]:.6f}  ref {ref_losses[0]:.6f}  "
          f"|diff| {abs(keel_losses[0] - ref_losses[0]):.2e}; last paired: Keel {keel_losses[len(ref_losses) - 1]:.6f}"
          f"  ref {ref_losses[-1]:.6f}", flush=True)


def single_process_env() -> None:
    """What a launcher would export for a world of one; values already set are kept."""
    from keel.launcher.local import free_port

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="keel-throughput-") as tmp:
        run_dir = write_run(args, Path(tmp) / "run")
        if args.ranks > 1:
            from throughput_ranks import launch

            return launch(run_dir, args)
        single_process_env()
        from keel.training.entry import exit_now, init_distributed, setup_logging

        init_distributed()
        setup_logging(0)
        trainer, initial = build_keel(run_dir)
        hf = hf_model(trainer, initial)
        del initial
        trainer.pair(hf_step(trainer, hf, DTYPES[args.precision]), args.warmup, args.steps, args.profile_steps)
        engine = trainer.engine
        header = (f"1 process | {sum(p.numel() for p in engine.module.parameters()) / 1e6:.2f}M params, dim "
                  f"{args.dim}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, vocab {args.vocab}, seq "
                  f"{args.seq_len}, global batch {args.global_batch} (micro {args.micro_batch}) | {args.precision}, "
                  f"{Path(args.ds_config).name} (ZeRO-{engine.zero_optimization_stage()}, "
                  f"{type(engine.optimizer).__name__}) | {engine.device}, {torch.get_num_threads()} threads | keel "
                  f"from {REPO}")
        # peak = best rate seen; measured before and after training, as load from other tenants only ever slows it
        peaks = {name: matmul_peak(dt, engine.device) for name, dt in DTYPES.items()}
        trainer.fit()
        peaks = {name: max(peaks[name], matmul_peak(dt, engine.device)) for name, dt in DTYPES.items()}
        report(trainer, "HF Llama + AdamW", peaks, args.precision, trainer.ref.losses, trainer.keel.losses, header)
        exit_now(0)  # gloo can abort in its destructors at interpreter exit


if __name__ == "__main__":
    main()
