"""Keel's real trainer step and a reference step, timed and profiled in alternating A/B pairs, and the report.

Shared by bench/throughput.py (one process, a plain HF loop) and bench/throughput_ranks.py (2 ranks, HF + DeepSpeed).
Keel's side is `Trainer.fit` unchanged: `PairedTrainer` only runs the reference step at the top of each
`train_step` call and reads the clock (and the profiler) at the seams, so a Keel iteration is its whole loop body.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from keel.config.rules import compile_setting
from keel.training.trainer import Trainer

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# GEMMs and attention, their autograd nodes included ("autograd::engine::evaluate_function: MmBackward0")
KERNELS = re.compile(
    r"(?:autograd::engine::evaluate_function: )?(?:aten::(?:mm|bmm|addmm|baddbmm|addbmm|matmul|"
    r"linear|_?scaled_dot_product\w*|_flash_attention\w*|_efficient_attention\w*)|"
    r"(?:Mm|Addmm|Bmm|Baddbmm|Addbmm)Backward\d*|ScaledDotProduct\w*Backward\d*)"
)


def sync(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(
    dtype: torch.dtype, device: torch.device, budget_s: float = 1.0
) -> tuple[float, int]:
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

    def pair(
        self, reference: Callable[[int], float], warmup: int, timed: int, profiled: int
    ) -> None:
        self.reference, self.phases = (
            reference,
            ["warmup"] * warmup + ["timed"] * timed + ["profile"] * profiled,
        )
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

    def save(self, state):
        """No checkpoint: the bench needs none, and the final save (after the last timed step) would only cost
        the wall time and disk of a full model and optimizer state."""
        from keel.run_dir import tag_for
        from keel.training.checkpoint.store import SaveOutcome

        return SaveOutcome(tag_for(state.step))


def build_keel(run_dir: Path):
    """This rank's trainer and an fp32 CPU copy of its initial model, built as keel/training/entry.py builds them."""
    from keel.data import IndexedDataset, PackedSamples
    from keel.engine.build import LRScale, build_engine, build_model
    from keel.parallel.random import data_parallel_seed, seed_everything
    from keel.parallel.topology import Topology
    from keel.run_dir import read_run_dir

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


def describe(args, trainer: PairedTrainer, n_params: int, ref_optimizer: str) -> str:
    """The report's header: world, shape, batch split, precision, DeepSpeed JSON and what both sides run."""
    engine = trainer.engine
    zero = engine.zero_optimization_stage()
    overlap = engine.zero_overlap_comm() if zero else "n/a"
    return (
        f"{args.ranks} rank(s) | {n_params / 1e6:.2f}M params, dim {args.dim}, {args.layers} layers, "
        f"{args.heads}/{args.kv_heads} heads, vocab {args.vocab}, seq {args.seq_len}, global batch "
        f"{args.global_batch} (micro {args.micro_batch}, accumulation {engine.gradient_accumulation_steps()}) | "
        f"{args.precision}, {Path(args.ds_config).name} (ZeRO-{zero}, overlap_comm {overlap}) | optimizer: Keel "
        f"{type(engine.optimizer).__name__}, ref {ref_optimizer} | {engine.device}, {torch.get_num_threads()} "
        f"threads per rank"
    )


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
    assert not any(getattr(m, "gradient_checkpointing", False) for m in hf.modules())
    return hf.to(trainer.engine.device).train()


def reference_batches(trainer: PairedTrainer) -> Callable[[int], list[torch.Tensor]]:
    """Step i's micro-batches for this rank: the samples Keel's step i reads, through the same `step_batch`."""
    from keel.data import step_batch

    t, topo = trainer.cfg.train, trainer.topology

    def batches(i: int) -> list[torch.Tensor]:
        return [
            mb.to(trainer.engine.device)
            for mb in step_batch(
                trainer.order,
                trainer.train_samples,
                i * t.global_batch_size,
                t.global_batch_size,
                t.micro_batch_size,
                topo.dp_rank,
                topo.dp_size,
            )
        ]

    return batches


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return (
        f"median {statistics.median(values):.3f} (IQR {q[0]:.3f}-{q[2]:.3f}, range {min(values):.3f}-"
        f"{max(values):.3f}, {len(values)} pairs)"
    )


def report(
    trainer: PairedTrainer,
    ref_name: str,
    peaks: dict[str, tuple[float, int]],
    precision: str,
    ref_losses: list[float],
    keel_losses: list[float],
    header: str,
) -> None:
    """The table and ratio lines; tokens are global (all ranks), peaks summed over ranks."""
    from keel.model import flops_per_token

    cfg, keel, ref = trainer.cfg, trainer.keel, trainer.ref
    fpt, tokens = (
        flops_per_token(cfg.model, cfg.data.seq_len),
        cfg.train.global_batch_size * cfg.data.seq_len,
    )
    print(f"\n{header}")
    if not keel.times or not ref.times:
        # a guard stopped Keel's trainer (its log line above says why): there is no step to compare
        print(
            f"no timed steps: Keel {len(keel.times)}, reference {len(ref.times)}; see the log above"
        )
        return
    cols = ("tokens/s", "step ms", *(f"MFU {n}" for n in peaks), "out-kern ms", "kernels ms")
    print(f"{'':<20}" + "".join(f"{c:>13}" for c in cols))
    for name, side in (("Keel (trainer step)", keel), (ref_name, ref)):
        step_s = statistics.median(side.times)
        prof = [
            statistics.median(x[i] for x in side.profiled) * 1e3 if side.profiled else float("nan")
            for i in (0, 1)
        ]
        cells = (
            f"{tokens / step_s:,.0f}",
            f"{step_s * 1e3:,.1f}",
            *(f"{fpt * tokens / step_s / peak:.1%}" for peak, _ in peaks.values()),
            *(f"{v:,.1f}" for v in prof),
        )
        print(f"{name:<20}" + "".join(f"{c:>13}" for c in cells))
    print(
        f"Keel/ref tokens/s: {spread([r / k for k, r in zip(keel.times, ref.times)])}; "
        f"total-time ratio {sum(ref.times) / sum(keel.times):.3f}"
    )
    if keel.profiled:
        print(
            f"Keel/ref self CPU time outside GEMM/attention per step (target <= 0.5): "
            f"{spread([k[0] / r[0] for k, r in zip(keel.profiled, ref.profiled)])}; profiled wall ms Keel "
            f"{statistics.median(k[2] for k in keel.profiled) * 1e3:,.1f}, ref "
            f"{statistics.median(r[2] for r in ref.profiled) * 1e3:,.1f}"
        )
    for name, (flops, n) in peaks.items():
        marker = "  <- MFU of this run" if name == precision else ""
        print(
            f"peak {name} matmul: {flops / 1e12:.4f} TFLOP/s ({n}x{n}, best of repeats, summed over ranks){marker}"
        )
    print(
        f"MFU = flops_per_token x tokens/s / peak; flops_per_token = 6N + 12*L*d*T = {fpt / 1e6:.2f} MFLOP "
        "(PaLM appendix B, no causal-mask discount); out-kern = profiler self CPU outside GEMM/SDPA"
    )
    if keel.warmup:
        compiled = compile_setting(cfg.model.compile) == "true"
        print(
            f"model.compile={compile_setting(cfg.model.compile)}: Keel's first step took {keel.warmup[0]:.1f} s"
            f"{' (compilation included)' if compiled else ''}"
        )
    print(
        f"first-step loss: Keel {keel_losses[0]:.6f}  ref {ref_losses[0]:.6f}  "
        f"|diff| {abs(keel_losses[0] - ref_losses[0]):.2e}; last paired: Keel {keel_losses[len(ref_losses) - 1]:.6f}"
        f"  ref {ref_losses[-1]:.6f}",
        flush=True,
    )
