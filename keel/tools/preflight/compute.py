"""Compute health: the same seeded matmul on every rank, its digest and an fp64 check, and matmul speed.

Silent data corruption (a bad ALU, failing memory, a marginal GPU) shows as a result that differs from what
identical hardware and software produce; ranks with the same `hardware_key` must agree bit for bit, so the
digest goes to a majority vote (judge.py). The fp64 check needs no peers: every element of the fp32 product
must lie within the rounding bound γ_n·(|A||B|) of the fp64 product (Higham, Accuracy and Stability of Numerical
Algorithms, §3.5), which any correct fp32 matmul meets and a corrupted element far exceeds. Speed is the best
of a few timed matmuls at the run's precision (fp32 on CPU), all ranks at once, as in training.
"""

from __future__ import annotations

import hashlib
import platform
import time
from dataclasses import dataclass

import torch

CHECK_N = 256
SPEED_N = {"cpu": 1024, "cuda": 8192}
SPEED_REPS = 5
SEED = 20261202
SLOW_FAULT_FACTOR = 8  # faults.preflight_slow_rank computes this many times slower


@dataclass(frozen=True)
class ComputeResult:
    hardware_key: str  # ranks with the same key must compute bit-identical results
    digest: str
    fp64_error: float  # the worst element's error as a fraction of its rounding bound (> 1: wrong)
    tflops: float
    dtype: str


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_key(device: str) -> str:
    """What decides a matmul's bits: the processor, the library versions, and on CPU the thread count (it
    changes how the product is blocked)."""
    parts = [cpu_model(), f"torch {torch.__version__}"]
    if device == "cuda":
        return " | ".join([*parts, torch.cuda.get_device_name(), f"cuda {torch.version.cuda}"])
    return " | ".join([*parts, f"threads {torch.get_num_threads()}"])


def check_matmul(device: str, corrupt: float = 0.0) -> tuple[str, float]:
    """(digest of the fp32 product, worst error against fp64 as a fraction of the rounding bound); `corrupt`:
    the relative error faults.preflight_bad_matmul_error puts into the largest element (0: none)."""
    gen = torch.Generator().manual_seed(SEED)
    a = torch.randn(CHECK_N, CHECK_N, generator=gen)
    b = torch.randn(CHECK_N, CHECK_N, generator=gen)
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the bound below is fp32's; TF32 rounds far more
    try:
        product = (a.to(device) @ b.to(device)).cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    if corrupt:
        worst = product.abs().argmax()
        product.view(-1)[worst] *= 1 + corrupt
    reference = a.double() @ b.double()
    unit = torch.finfo(torch.float32).eps / 2
    gamma = CHECK_N * unit / (1 - CHECK_N * unit)
    bound = gamma * (a.double().abs() @ b.double().abs())
    error = ((product.double() - reference).abs() / bound).max().item()
    return hashlib.sha256(product.numpy().tobytes()).hexdigest()[:16], error


def matmul_tflops(device: str, dtype: torch.dtype, slow: bool) -> float:
    n = SPEED_N["cuda" if device == "cuda" else "cpu"]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for rep in range(SPEED_REPS + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - start
        if slow:  # stands in for a throttled or failing processor
            time.sleep(took * (SLOW_FAULT_FACTOR - 1))
            took *= SLOW_FAULT_FACTOR
        if rep:  # the first is the warm-up
            best = min(best, took)
    return 2 * n**3 / best / 1e12


def measure_compute(device: str, precision: str, corrupt: float, slow: bool) -> ComputeResult:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if device != "cuda":
        dtype = torch.float32  # 16-bit matmuls on CPU say little about training speed there
    digest, error = check_matmul(device, corrupt)
    return ComputeResult(
        hardware_key(device),
        digest,
        error,
        matmul_tflops(device, dtype, slow),
        str(dtype).removeprefix("torch."),
    )
