"""The devices a plan is made for: peak matmul rates, memory, and the bandwidths a step's communication meets.

Figures are the vendors' dense (not sparse) peaks per GPU; links are per GPU and per direction: NVLink within a
node (H100/H200 900 GB/s bidirectional → 450), InfiniBand between nodes (one 400 Gb/s NDR NIC per GPU → 50 GB/s;
A100 systems: 200 Gb/s HDR → 25). `--preflight preflight.json` replaces the matmul rate and the link bandwidth with
what `keel preflight` measured. CPU is measured here: a plan for this machine times its own GEMMs.

GEMM efficiency (achieved ÷ peak) falls with the GEMMs' size. The GPU curve is measured: bf16 GEMMs of a Llama
block on an H200 (bench/gemm_efficiency.py; bench/results/device_check_gpu_20261204.md), median TFLOP/s by the
harmonic mean of width and tokens, which orders the measured points; a size between two points is interpolated in
log2, below the smallest one it falls in proportion.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any

# (harmonic mean of width and tokens, achieved ÷ dense peak): an H200's median bf16 GEMM rate over 989 TFLOP/s
H200_GEMM_EFFICIENCY = (
    (1365, 0.255),
    (2048, 0.457),
    (2731, 0.599),
    (3277, 0.632),
    (5461, 0.668),
    (8192, 0.658),
)


@dataclass(frozen=True)
class Device:
    name: str
    bf16_tflops: float  # dense peak (fp32 on CPU)
    fp8_tflops: float  # 0: no FP8 tensor cores
    memory_gib: float  # per device (CPU: the host's, shared by its ranks)
    hbm_tbps: float  # memory bandwidth, for the optimizer's update
    intra_gbps: float  # per device, one direction, within a node
    inter_gbps: float  # per device, one direction, between nodes
    source: str
    measured_gemm: bool = False  # CPU: GEMM rates timed on this machine, not from the curve

    def gemm_efficiency(self, width: int, tokens: int) -> float:
        """Achieved ÷ peak for a GEMM of this width over this many tokens (the H200 curve)."""
        size = 2 / (1 / max(width, 1) + 1 / max(tokens, 1))
        points = H200_GEMM_EFFICIENCY
        if size <= points[0][0]:
            return points[0][1] * size / points[0][0]
        for (x0, e0), (x1, e1) in zip(points, points[1:]):
            if size <= x1:
                f = (math.log2(size) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
                return e0 + f * (e1 - e0)
        return points[-1][1]


DEVICES = {
    "h100": Device(
        "H100 SXM 80GB",
        989.0,
        1979.0,
        80.0,
        3.35,
        450.0,
        50.0,
        "NVIDIA H100 Tensor Core GPU datasheet",
    ),
    "h200": Device(
        "H200 SXM 141GB",
        989.0,
        1979.0,
        141.0,
        4.8,
        450.0,
        50.0,
        "NVIDIA H200 Tensor Core GPU datasheet",
    ),
    "b200": Device(
        "B200 180GB",
        2250.0,
        4500.0,
        180.0,
        8.0,
        900.0,
        50.0,
        "NVIDIA DGX B200 / HGX B200 specifications",
    ),
    "a100": Device(
        "A100 SXM 80GB",
        312.0,
        0.0,
        80.0,
        2.04,
        300.0,
        25.0,
        "NVIDIA A100 Tensor Core GPU datasheet",
    ),
}


def cpu_device(ranks_per_node: int) -> Device:
    """This machine: fp32 GEMM rate measured now (the largest of a few sizes), the host's memory, loopback."""
    import os

    import psutil
    import torch

    # a rank's share of the cores, as the launcher gives it (OMP_NUM_THREADS = cores / ranks)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_per_node))
    best = max(_gemm_tflops(n, n, n) for n in (512, 1024, 2048))
    return Device(
        "this CPU (fp32, measured)",
        best,
        0.0,
        psutil.virtual_memory().total / 2**30,
        10.0,
        2.0,
        2.0,
        f"measured here: torch {torch.__version__}, {torch.get_num_threads()} threads",
        measured_gemm=True,
    )


def with_preflight(device: Device, preflight: dict[str, Any]) -> Device:
    """`keel preflight`'s measured matmul rate (its slowest rank's) and link bandwidth (its slowest pair's)."""
    ranks = preflight.get("ranks", [])
    rates = [r.get("compute", {}).get("tflops") for r in ranks]
    rates = [r for r in rates if r]
    links = [r.get("link_gbps") for r in preflight.get("links", []) if r.get("link_gbps")]
    changes: dict[str, Any] = {}
    if rates:
        changes["bf16_tflops"] = min(rates)
    if links:
        changes["intra_gbps"] = min(links)
    return replace(device, **changes) if changes else device


_TIMED: dict[tuple[int, int, int], float] = {}


def _gemm_tflops(m: int, k: int, n: int) -> float:
    """fp32 TFLOP/s of an m×k @ k×n matmul on this CPU (best of a few), cached by shape."""
    import torch

    key = (m, k, n)
    if key not in _TIMED:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b  # warm
        best, reps = math.inf, 1
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(reps):
                a @ b
            elapsed = time.perf_counter() - start
            best = min(best, elapsed / reps)
            reps = max(reps, int(reps * 5e-3 / max(elapsed, 1e-9)) + 1)  # time ≥ 5 ms at a go
        _TIMED[key] = 2 * m * k * n / best / 1e12
    return _TIMED[key]


def cpu_gemm_seconds(m: int, k: int, n: int) -> float:
    """Seconds for an m×k @ k×n fp32 matmul on this CPU, timed at a capped size and scaled by FLOPs."""
    if not m * k * n:
        return 0.0
    cap = 2048
    tm, tk, tn = min(m, cap), min(k, cap), min(n, cap)
    return 2 * m * k * n / (_gemm_tflops(tm, tk, tn) * 1e12)


_BLOCKS: dict[tuple, float] = {}
BLOCK_TOKENS = 2048  # a CPU block is timed on at most this many tokens, then scaled


def cpu_block_seconds(model, tp: int, micro_batch: int, seq_len: int, moe: bool) -> float:
    """Forward and backward of one of Keel's blocks at this rank's tensor-parallel shard, timed on this CPU:
    GEMMs, norms, RoPE, attention, SwiGLU and the framework's per-op cost together (at a small width the
    GEMMs are a minority). Timed on up to BLOCK_TOKENS tokens (whole sequences where they fit) and scaled by
    tokens; cached by shape."""
    import torch

    from keel.model.llama import Block
    from keel.parallel import comm
    from keel.parallel.layer_parallel import EPContext, LayerParallel
    from keel.parallel.tensor import TPContext

    seq = min(seq_len, BLOCK_TOKENS)
    batch = max(1, min(micro_batch, BLOCK_TOKENS // seq))
    key = (repr(model), tp, batch, seq, moe)
    if key not in _BLOCKS:
        layer_id = next(
            i
            for i in range(model.n_layers)
            if moe == bool(model.moe_experts and (i + 1) % model.moe_every == 0)
        )
        torch.manual_seed(0)
        # one rank's shard, its collectives inert (no process group here: the plan times them apart)
        group = comm.Group("tp", tuple(range(tp)), 0, comm.DEVICE)
        parallel = LayerParallel(
            tp=TPContext(group, 0, tp), ep=EPContext(rank=0, size=1, ranks=(0,))
        )
        block = Block(model, layer_id, parallel)
        x = torch.randn(batch, seq, model.dim, requires_grad=True)
        best = math.inf
        for _ in range(3):  # the first is the warm-up
            start = time.perf_counter()
            block(x).sum().backward()
            best = min(best, time.perf_counter() - start)
        _BLOCKS[key] = best
    measured_tokens = batch * seq
    return _BLOCKS[key] * micro_batch * seq_len / measured_tokens
