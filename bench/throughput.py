"""Keel training throughput and MFU, against this machine's matmul peak and a plain Hugging Face loop.

Why: a tokens/s figure means little on its own. This script puts two yardsticks next to it, both measured in
the same run on the same machine and thread count, so no number here is ever hard-coded:

* the peak: the best large square matmul rate, in bf16 and in fp32, which gives MFU = flops_per_token · tokens/s
  / peak, with flops_per_token = 6·N + 12·L·d·T (PaLM, Chowdhery et al. 2022, appendix B; `keel.model.flops_per_token`);
* the baseline: the same model trained as `transformers.LlamaForCausalLM` with a plain torch AdamW loop, which
  gives the ratio Keel/HF, i.e. what the DeepSpeed engine and Keel's layers cost or gain over the obvious loop.

The comparison is kept apples to apples: the HF model starts from Keel's weights (`to_hf_state_dict`), both use
SDPA attention, see the same random token batches, compute an fp32 cross-entropy on already-shifted labels (HF:
F.cross_entropy, Keel: its vocab-parallel loss, the same value at tp=1), and run AdamW with the same
hyper-parameters (no weight decay on 1-D params), LR schedule and gradient clipping.
The first-step losses are printed side by side as the proof: they agree to ~1e-6 (fp32 and bf16 alike, as the
weights start equal); the last-step losses drift apart only by rounding, visibly so in bf16.

Both loops run interleaved, one step each in turn, so load from other tenants of a shared machine hits both
alike. The ratio is printed from total time and as the median of per-step ratios; when the two disagree the
machine was noisy, so rerun. The peak is the best rate seen, measured before and after training.

Precision. `--precision bf16` sets `bf16.enabled` in the DeepSpeed JSON (and disables fp16). DeepSpeed then keeps
the module in bf16 and fp32 master weights in its optimizer wrapper (ZeRO-0: FP16_UnfusedOptimizer in bf16 mode;
`--ds-config ds_configs/bf16.json`, ZeRO-1: its ZeRO optimizer). The HF loop mirrors that by hand: bf16 model for
forward/backward, fp32 master copies for clipping and AdamW, copied back after each step. (torch.autocast over
fp32 weights would be the other plain-torch choice, but it computes differently from what DeepSpeed does.)
On a CPU without native bf16 (AVX2 only) bf16 matmuls run tens of times slower than fp32; there, try bf16 with
small shapes or few steps, e.g. `--precision bf16 --steps 2 --warmup 1`.

One process, no launcher: `python bench/throughput.py [--precision bf16] [--help]`.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

import keel
from keel.config import DataConfig, ModelConfig, RunConfig, TrainConfig, validate
from keel.model import causal_lm_loss, flops_per_token, num_params, to_hf_config, to_hf_state_dict
from keel.training.ds_config import load_ds_config, precision
from keel.training.lr_schedule import build_scheduler

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps before timing")
    p.add_argument("--precision", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--ds-config", default=str(REPO / "ds_configs" / "zero0.json"),
                   help="DeepSpeed JSON; its bf16.enabled is set from --precision")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compile", action="store_true", help="Keel with model.compile (each block torch.compile'd); "
                   "the first step's time, compilation included, is printed")
    return p.parse_args()


def single_process_env() -> None:
    """What a launcher would export for a world of one; values already set are kept."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)


def build_run_config(args: argparse.Namespace) -> RunConfig:
    model = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                        n_kv_heads=args.kv_heads, compile=args.compile)
    # global batch = micro batch (no accumulation); a constant LR still runs through Keel's LambdaLR
    train = TrainConfig(steps=args.warmup + args.steps, seed=args.seed, global_batch_size=args.micro_batch,
                        micro_batch_size=args.micro_batch, lr_schedule="constant", warmup_steps=0,
                        ds_config=args.ds_config)
    cfg = RunConfig(model=model, data=DataConfig(seq_len=args.seq_len), train=train)
    validate(cfg, world_size=1)
    return cfg


def sync(device: torch.device) -> None:
    if device.type == "cuda":
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


def make_batches(cfg: RunConfig, count: int, device: torch.device) -> list[torch.Tensor]:
    """`count` random [micro_batch, seq_len + 1] token batches from a fixed generator; both loops get these."""
    gen = torch.Generator().manual_seed(cfg.train.seed)
    shape = (cfg.train.micro_batch_size, cfg.data.seq_len + 1)
    return [torch.randint(cfg.model.vocab_size, shape, generator=gen).to(device) for _ in range(count)]


def run_interleaved(steps: dict, batches: list[torch.Tensor], warmup: int, device: torch.device) -> dict:
    """Feed every batch to each `step(inputs, labels) -> loss` in turn; returns name → (losses, timed step seconds).

    Interleaving step by step, rather than timing one loop after the other, spreads any drift in machine load
    (other tenants, frequency changes) over both, so their ratio is trustworthy on a noisy machine.
    """
    results = {name: ([], [], []) for name in steps}  # losses, timed step seconds, warm-up step seconds
    for i, batch in enumerate(batches):
        for name, step in steps.items():
            sync(device)
            start = time.perf_counter()
            loss = step(batch[:, :-1], batch[:, 1:])
            sync(device)
            elapsed = time.perf_counter() - start
            results[name][0].append(loss)
            results[name][1 if i >= warmup else 2].append(elapsed)
    return results


def keel_step(engine, topology):
    """One optimizer step exactly as `keel.training.trainer.Trainer.train_step` drives the engine (GA = 1)."""
    from keel.training.engine import Fp32GradClipper

    Fp32GradClipper(engine, topology)  # as the Trainer: Keel clips the plain fp32 ZeRO-0 path itself

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> float:
        engine.set_gradient_accumulation_boundary(True)
        loss = engine(inputs, labels)
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step


def hf_step(model, cfg: RunConfig, dtype: torch.dtype):
    """The plain loop: forward, fp32 cross-entropy, backward, clip, AdamW (on fp32 masters when `dtype` is bf16)."""
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]  # a tied weight appears once
    masters = params if dtype == torch.float32 else [p.detach().float().clone() for p in params]
    groups = [{"params": [m for m in masters if m.ndim >= 2], "weight_decay": t.weight_decay},
              {"params": [m for m in masters if m.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)
    scheduler = build_scheduler(optimizer, t)

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> float:
        # HF's own `labels=` loss shifts them again; ours are already shifted, so compute the loss as Keel does
        loss = causal_lm_loss(model(input_ids=inputs, use_cache=False).logits, labels)
        loss.backward()
        if masters is not params:
            for p, m in zip(params, masters):
                m.grad, p.grad = p.grad.float(), None
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(masters, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if masters is not params:
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        return loss.item()

    return step


def main() -> None:
    args = parse_args()
    single_process_env()
    from transformers import LlamaForCausalLM

    from keel.parallel.topology import Topology
    from keel.training.engine import build_engine, build_model
    from keel.training.entry import init_distributed, setup_logging

    cfg = build_run_config(args)
    init_distributed()
    setup_logging(0)
    ds_raw = load_ds_config(cfg.train.ds_config)
    ds_raw["bf16"] = {**ds_raw.get("bf16", {}), "enabled": args.precision == "bf16"}
    if "fp16" in ds_raw:
        ds_raw["fp16"] = {**ds_raw["fp16"], "enabled": False}
    assert precision(ds_raw) == args.precision
    dtype = DTYPES[args.precision]

    # HF copy first: DeepSpeed casts the Keel module in place (bf16) when it builds the engine
    model = build_model(cfg)
    hf_cfg = to_hf_config(cfg.model, max_position_embeddings=max(cfg.data.seq_len, 2048))
    hf_cfg._attn_implementation = "sdpa"
    hf_cfg.use_cache = False
    hf = LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    topology = Topology.from_env()
    engine = build_engine(cfg, ds_raw, topology, model=model)
    device = engine.device
    hf.to(device).train()
    with torch.no_grad():  # parameters only: HF's RoPE inv_freq stays fp32, as Keel's tables are computed in fp32
        for p in hf.parameters():
            p.data = p.data.to(dtype)
    assert hf.config._attn_implementation == "sdpa", hf.config._attn_implementation

    batches = make_batches(cfg, args.warmup + args.steps, device)
    tokens = args.steps * cfg.train.micro_batch_size * cfg.data.seq_len
    threads = torch.get_num_threads()
    print(f"model: {num_params(model) / 1e6:.2f}M params, dim {args.dim}, {args.layers} layers, "
          f"{args.heads}/{args.kv_heads} heads, vocab {args.vocab}, seq {args.seq_len}, micro-batch "
          f"{args.micro_batch} | {args.precision}, {Path(args.ds_config).name} "
          f"(ZeRO-{engine.zero_optimization_stage()}, {type(engine.optimizer).__name__}) | device {device}, "
          f"{threads} threads | keel from {Path(keel.__file__).parent.parent}", flush=True)

    # peak = best rate seen; measured before and after training, as load from other tenants only ever slows it
    peaks = {name: matmul_peak(dt, device) for name, dt in DTYPES.items()}
    steps = {"keel": keel_step(engine, topology), "hf": hf_step(hf, cfg, dtype)}
    results = run_interleaved(steps, batches, args.warmup, device)
    (keel_losses, keel_times, keel_warmup), (hf_losses, hf_times, _) = results["keel"], results["hf"]

    peaks = {name: max(peaks[name], matmul_peak(dt, device)) for name, dt in DTYPES.items()}  # by FLOP/s first

    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    keel_tps, hf_tps = tokens / sum(keel_times), tokens / sum(hf_times)
    rows = [("", "tokens/s", "step ms", *(f"MFU vs {n}" for n in DTYPES))]
    for name, tps in (("Keel (DeepSpeed)", keel_tps), ("HF Llama + AdamW", hf_tps)):
        step_ms = 1e3 * cfg.train.micro_batch_size * cfg.data.seq_len / tps
        rows.append((name, f"{tps:,.0f}", f"{step_ms:,.1f}", *(f"{fpt * tps / peaks[n][0]:.1%}" for n in DTYPES)))
    print()
    for row in rows:
        print(f"{row[0]:<18}" + "".join(f"{cell:>14}" for cell in row[1:]))
    paired = statistics.median(h / k for k, h in zip(keel_times, hf_times))  # neighbours share the machine's load
    print(f"\nKeel/HF tokens/s ratio: {keel_tps / hf_tps:.3f} (total time), {paired:.3f} (median of per-step "
          f"ratios); {args.steps} timed steps each after {args.warmup} warm-up, interleaved")
    for name, (flops, n) in peaks.items():
        marker = "  <- MFU of this run" if name == args.precision else ""
        print(f"peak {name} matmul: {flops / 1e12:.4f} TFLOP/s ({n}x{n}, best of repeats){marker}")
    print(f"MFU = flops_per_token x tokens/s / peak; flops_per_token = 6N + 12*L*d*T = {fpt / 1e6:.2f} MFLOP "
          "(PaLM appendix B, no causal-mask discount)")
    if fpt * max(keel_tps, hf_tps) > peaks[args.precision][0]:
        print(f"note: MFU above 100%: the {args.precision} square-matmul rate is no true peak here (a busy machine, "
              "or bf16 emulated on a CPU without native bf16)")
    if args.compile:
        print(f"model.compile: Keel's first step took {keel_warmup[0]:.1f} s (compilation included); over 1000 "
              f"steps compiled Keel takes {keel_warmup[0] + 1000 * sum(keel_times) / len(keel_times):.0f} s")
    diff = abs(keel_losses[0] - hf_losses[0])
    print(f"first-step loss: Keel {keel_losses[0]:.6f}  HF {hf_losses[0]:.6f}  |diff| {diff:.2e}; "
          f"last: Keel {keel_losses[-1]:.6f}  HF {hf_losses[-1]:.6f}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo can abort in its destructors at interpreter exit


if __name__ == "__main__":
    main()
