"""Matmul speed by shape: the efficiency curve a step-time model needs, and FP8's gain over bf16 on the same GEMMs.

A planner predicts compute time as FLOPs ÷ (peak × efficiency), and the efficiency of one GEMM depends on its
size: a Llama block's projections at micro-batch 1 and a small hidden size reach a fraction of the peak that a
large square matmul reaches. This measures that curve on the shapes of Keel's own linears (tokens × in → out for
wq/wkv/wo/w13/w2 and the output head at the given widths), forward (X·Wᵀ) and the two backward GEMMs, so the model
is fitted to what the device does rather than to a spec sheet.

Per shape: median TFLOP/s over the repeats (CUDA events on a GPU, perf_counter on CPU), its fraction of the largest
square matmul's speed measured in the same run, and on a GPU with FP8 (compute capability ≥ 8.9) the speed of
`torch._scaled_mm` in e4m3 with tensorwise and rowwise scales on the same shape (the GEMM alone: no casts or amax,
which torchao's recipes add) and its ratio to bf16. Variants alternate repeat by repeat.

    python bench/gemm_efficiency.py [--dims 1024,2048,4096,8192] [--tokens 2048,8192,16384] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], device: str) -> float:
    """Seconds one call takes, on the device's own clock where there is one."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def block_shapes(dim: int, tokens: int, vocab: int) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of a Llama block's GEMMs at width dim (GQA with kv = heads/4, ffn ≈ 8/3·dim to 256)."""
    ffn = 256 * ((8 * dim // 3 + 255) // 256)
    kv = dim // 4
    shapes = []
    for name, out_features, in_features in (
        ("wq", dim, dim),
        ("wkv", 2 * kv, dim),
        ("wo", dim, dim),
        ("w13", 2 * ffn, dim),
        ("w2", dim, ffn),
        ("head", vocab, dim),
    ):
        shapes.append((f"{name} fwd", tokens, out_features, in_features))  # X[t,in] · Wᵀ
        shapes.append((f"{name} dgrad", tokens, in_features, out_features))  # dY[t,out] · W
        shapes.append((f"{name} wgrad", out_features, in_features, tokens))  # dYᵀ · X
    return shapes


def fp8_matmuls(m: int, n: int, k: int, device: str) -> dict[str, Callable[[], object]]:
    """torch._scaled_mm in e4m3, tensorwise and rowwise scales; empty where the device has no FP8 GEMM."""
    if device != "cuda" or torch.cuda.get_device_capability() < (8, 9):
        return {}
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = (
        torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    )  # column-major, as _scaled_mm needs
    one = torch.ones((), device=device)
    rows, cols = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
    out = torch.bfloat16
    return {
        "fp8 tensorwise": lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=out),
        "fp8 rowwise": lambda: torch._scaled_mm(a, b, scale_a=rows, scale_b=cols, out_dtype=out),
    }


def measure(
    m: int, n: int, k: int, device: str, dtype: torch.dtype, repeats: int
) -> dict[str, float]:
    """Median TFLOP/s of each variant on one (m, n, k), variants interleaved."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    variants: dict[str, Callable[[], object]] = {
        "matmul": lambda: a @ b,
        **fp8_matmuls(m, n, k, device),
    }
    for fn in variants.values():
        for _ in range(2):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(timed(fn, device))
    flops = 2.0 * m * n * k
    return {name: flops / statistics.median(ts) / 1e12 for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dims", default=None, help="model widths (default: 1024..8192 on GPU, 256..1024 on CPU)"
    )
    parser.add_argument("--tokens", default=None, help="tokens per micro-batch (micro-batch × seq)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dims = [
        int(d)
        for d in (
            args.dims or ("1024,2048,4096,8192" if device == "cuda" else "256,512,1024")
        ).split(",")
    ]
    tokens = [
        int(t)
        for t in (args.tokens or ("2048,8192,16384" if device == "cuda" else "256,1024")).split(",")
    ]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device {name}, {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads")

    square = 8192 if device == "cuda" else 1024
    peak = measure(square, square, square, device, dtype, args.repeats)["matmul"]
    print(f"square {square}³ matmul: {peak:.2f} TFLOP/s (the reference for 'eff')")
    print(
        f"{'dim':>5} {'tokens':>6} {'gemm':<11} {'m':>6} {'n':>6} {'k':>6} {'TFLOP/s':>8} {'eff':>5}  fp8 (×bf16)"
    )
    for dim in dims:
        for t in tokens:
            for label, m, n, k in block_shapes(dim, t, args.vocab if device == "cuda" else 4096):
                speeds = measure(m, n, k, device, dtype, args.repeats)
                base = speeds.pop("matmul")
                fp8 = "  ".join(f"{v}: {s:.0f} ({s / base:.2f}×)" for v, s in speeds.items())
                print(
                    f"{dim:>5} {t:>6} {label:<11} {m:>6} {n:>6} {k:>6} {base:>8.2f} {base / peak:>5.2f}  {fp8}"
                )


if __name__ == "__main__":
    main()
