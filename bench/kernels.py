"""Per-kernel forward+backward time and peak memory: Keel's eager torch path against `torch.compile` of the same
function and, on CUDA where liger-kernel imports, Liger's Triton kernel.

Kernels (the shapes of a Llama block's elementwise work, fp32 on CPU, bf16 on CUDA by default):
  rmsnorm   keel.model.layers.RMSNorm's own forward on [tokens, dim] (its weight passed in by functional_call)
  rope      keel.model.layers.apply_rotary on q [b, heads, s, hd] and k [b, kv_heads, s, hd]
  swiglu    silu(gate) * up on [tokens, ffn]
  ce        keel.parallel.cross_entropy.vocab_parallel_cross_entropy (tp = 1) on [tokens, vocab] logits
  linear-ce the output projection then that loss, [tokens, dim] × [vocab, dim] (Liger: fused, no full logits)

Each variant runs forward and backward on the same inputs; variants alternate repeat by repeat (A/B interleaved)
and the median time is printed with its ratio to eager. Peak memory is what the call allocates on top of its
inputs: on CUDA `max_memory_allocated`; on CPU the peak RSS of the call above the RSS before it, after glibc's
`malloc_trim` returned every free page (so the call's allocations, eager or compiled, become new resident pages).

    python bench/kernels.py [--tokens 4096] [--dim 1024] [--repeats 20] [--kernels rmsnorm,rope,...]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from keel.model.kernels import apply_rotary, fused_linear_cross_entropy, rms_norm, rotary, silu_mul  # noqa: E402
from keel.model.layers import RMSNorm  # noqa: E402
from keel.parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402

Inputs = list[torch.Tensor]


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, labels, None, 0, logits.shape[-1])


def linear_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return ce(F.linear(hidden, weight), labels)


def make_inputs(name: str, args: argparse.Namespace, device: str, dtype: torch.dtype) -> Inputs:
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int, grad: bool = True, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dt).requires_grad_(grad)

    t, d, hd = args.tokens, args.dim, 64
    if name == "rmsnorm":
        return [rand(t, d), rand(d)]
    if name == "rope":
        s = min(t, 2048)
        b, heads = max(1, t // s), d // hd
        angles = torch.arange(s).float()[:, None] * (
            1e-4 ** (torch.arange(hd) % (hd // 2) / (hd // 2))
        )
        return [
            rand(b, heads, s, hd),
            rand(b, max(1, heads // 4), s, hd),
            angles.cos().to(device, dtype),
            angles.sin().to(device, dtype),
        ]
    if name == "swiglu":
        return [rand(t, args.ffn), rand(t, args.ffn)]
    labels = torch.randint(0, args.vocab, (t,), generator=g).to(device)
    if name == "ce":
        return [rand(t, args.vocab), labels]
    return [
        rand(t, d),
        (torch.randn(args.vocab, d, generator=g) * 0.02).to(device, dtype).requires_grad_(),
        labels,
    ]


def liger_variant(name: str) -> Callable | None:
    """Liger's kernel for `name` (CUDA only: Triton), or None where it cannot run."""
    if not torch.cuda.is_available():
        return None
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    except ImportError:
        return None
    # the rest through Keel's own entry points (keel/model/kernels.py): what `model.kernels=liger` trains with
    return {
        "rmsnorm": lambda x, w: rms_norm(x, w, 1e-5, liger=True),
        "rope": lambda q, k, cos, sin: rotary(q, k, cos, sin, liger=True),
        "swiglu": lambda a, b: silu_mul(a, b, liger=True),
        "ce": lambda x, y: _first(LigerCrossEntropyFunction.apply(x, y, None)),  # no class weights
        "linear-ce": lambda h, w, y: fused_linear_cross_entropy(h, w, y, w.shape[0], 0.0, 0.0),
    }[name]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def cpu_peak_bytes(fn: Callable, inputs: Inputs) -> int:
    """Peak RSS of one call above the RSS before it (VmHWM reset through /proc/self/clear_refs). glibc's
    `malloc_trim` first hands every free page back to the kernel, so whatever the call allocates — eager or
    inductor kernels alike (a dispatch mode would not see the latter) — shows up as new resident pages."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    fwd_bwd(fn, inputs)
    return (_status_kib("VmHWM") - before) * 1024


def fwd_bwd(fn: Callable, inputs: Inputs) -> None:
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward([o for o in outs], [torch.ones_like(o) for o in outs])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_bytes(fn: Callable, inputs: Inputs, device: str) -> int:
    # the previous call's gradients are freed before the baseline, not inside the call
    for t in inputs:
        t.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd(fn, inputs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return cpu_peak_bytes(fn, inputs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default=None,
        help="default: bf16 on CUDA, fp32 on CPU",
    )
    p.add_argument("--kernels", default="rmsnorm,rope,swiglu,ce,linear-ce")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        args.precision or ("bf16" if device == "cuda" else "fp32")
    ]
    norm = RMSNorm(args.dim).to(device, dtype)

    def rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(norm, {"weight": weight}, (x,))

    functions = {
        "rmsnorm": rmsnorm,
        "rope": rope,
        "swiglu": swiglu,
        "ce": ce,
        "linear-ce": linear_ce,
    }
    print(
        f"device {device} ({torch.cuda.get_device_name() if device == 'cuda' else os.cpu_count()} "
        f"{'GPU' if device == 'cuda' else 'CPUs'}), {dtype}, tokens {args.tokens}, dim {args.dim}, ffn {args.ffn}, "
        f"vocab {args.vocab}, {args.repeats} interleaved repeats, torch {torch.__version__}"
    )
    header = f"{'kernel':<10}{'variant':<10}{'fwd+bwd ms':>12}{'speedup':>10}{'peak MiB':>10}{'x eager':>10}"
    print(header)
    for name in args.kernels.split(","):
        eager = functions[name]
        variants = {"eager": eager, "compile": torch.compile(eager)}
        liger = liger_variant(name)
        if liger is not None:
            variants["liger"] = liger
        inputs = make_inputs(name, args, device, dtype)
        for fn in variants.values():  # warm-up (compilation, autotuning) outside the timing
            fwd_bwd(fn, inputs)
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            for variant, fn in variants.items():
                sync(device)
                start = time.perf_counter()
                fwd_bwd(fn, inputs)
                sync(device)
                times[variant].append(time.perf_counter() - start)
        peaks = {variant: peak_bytes(fn, inputs, device) for variant, fn in variants.items()}
        base_t, base_m = statistics.median(times["eager"]), max(peaks["eager"], 1)
        for variant in variants:
            t = statistics.median(times[variant])
            print(
                f"{name:<10}{variant:<10}{t * 1e3:>12.3f}{base_t / t:>9.2f}x{peaks[variant] / 2**20:>10.1f}"
                f"{peaks[variant] / base_m:>9.2f}x"
            )
        if liger is None:
            why = "no CUDA" if device == "cpu" else "liger-kernel not importable"
            print(f"{name:<10}{'liger':<10}  not run: {why}")


if __name__ == "__main__":
    main()
