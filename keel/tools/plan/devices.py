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
from dataclasses import dataclass, field, replace
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
    # one collective call's fixed cost, whatever its size: NCCL's small-message all-reduce, about (nccl-tests
    # on 8-GPU NVLink nodes and across InfiniBand); on CPU gloo's, measured
    intra_latency_us: float = 15.0
    inter_latency_us: float = 30.0
    # the share of backward that hides a data-parallel reduction DeepSpeed overlaps (`overlap_comm`): a GPU
    # computes while its copy engines and NICs move bytes; on CPU the collective runs on the cores that compute
    overlap: float = 0.7
    # CPU: GEMMs and blocks timed on this machine instead of the curve (None: a GPU from the table)
    timer: CpuTimer | None = field(default=None, compare=False)

    @property
    def is_cpu(self) -> bool:
        return self.timer is not None

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
    """This machine: fp32 GEMM rate measured now (the largest of a few sizes), the host's memory, and gloo's
    all-reduce between this many ranks (its latency and bus bandwidth, as the ranks' collectives meet them)."""
    import os

    import psutil
    import torch

    # a rank's share of the cores, as the launcher gives it (OMP_NUM_THREADS = cores / ranks)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_per_node))
    timer = CpuTimer()
    best = max(timer.gemm_tflops(n, n, n) for n in (512, 1024, 2048))
    latency, bus_gbps = timer.gloo_link(max(2, ranks_per_node))
    return Device(
        "this CPU (fp32, measured)",
        best,
        0.0,
        psutil.virtual_memory().total / 2**30,
        10.0,
        bus_gbps,
        bus_gbps,
        f"measured here: torch {torch.__version__}, {torch.get_num_threads()} threads, gloo",
        intra_latency_us=latency * 1e6,
        inter_latency_us=latency * 1e6,
        overlap=0.0,
        timer=timer,
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


class CpuTimer:
    """This CPU's GEMMs and Keel blocks, timed at the shapes a plan asks about, each shape once."""

    GEMM_CAP = 2048  # a GEMM dimension is timed up to this, then scaled by FLOPs
    BLOCK_TOKENS = 2048  # a block is timed on at most this many tokens, then scaled

    def __init__(self) -> None:
        self._gemms: dict[tuple[int, int, int], float] = {}
        self._blocks: dict[tuple, float] = {}

    def gemm_tflops(self, m: int, k: int, n: int) -> float:
        """fp32 TFLOP/s of an m×k @ k×n matmul (best of a few runs of ≥ 5 ms each)."""
        import torch

        key = (m, k, n)
        if key not in self._gemms:
            a, b = torch.randn(m, k), torch.randn(k, n)
            a @ b  # warm
            best, reps = math.inf, 1
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(reps):
                    a @ b
                elapsed = time.perf_counter() - start
                best = min(best, elapsed / reps)
                reps = max(reps, int(reps * 5e-3 / max(elapsed, 1e-9)) + 1)
            self._gemms[key] = 2 * m * k * n / best / 1e12
        return self._gemms[key]

    # two activation-sized all-reduces: a call's fixed cost, then its bandwidth
    LINK_BYTES = (512 << 10, 8 << 20)
    LINK_SECONDS = 0.3  # each size is called back to back for about this long

    def gloo_link(self, ranks: int) -> tuple[float, float]:
        """(seconds, GB/s): a gloo all-reduce's fixed cost and its bus bandwidth between `ranks` ranks of this
        process (one thread each: the bytes take the same loopback and memory as between processes, and nothing
        needs to be launched), fitted to two sizes. A step calls its collectives back to back, so each size is
        timed as the mean over a loop of calls: the rare slow call (a rank woken late) is part of what a step
        pays, and it dominates on a loaded host — the median of calls timed one by one left it out and put a
        512 KiB all-reduce at 0.75 ms where a loop of them averages 2.3 ms (this 2-core machine)."""
        import threading
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        store = dist.HashStore()
        groups: dict[int, Any] = {}
        times: dict[tuple[int, int], float] = {}

        def rank_main(rank: int) -> None:
            group = dist.ProcessGroupGloo(store, rank, ranks, timedelta(seconds=60))
            groups[rank] = group  # kept until every rank is done
            for nbytes in self.LINK_BYTES:
                tensor = torch.ones(max(1, nbytes // 4))
                start = time.perf_counter()
                group.allreduce([tensor]).wait()  # warm, and a first guess of a call's time
                calls = max(5, int(self.LINK_SECONDS / max(time.perf_counter() - start, 1e-6)))
                summed = torch.tensor([calls])
                group.allreduce([summed]).wait()  # every rank loops as often: the ranks' mean guess
                calls = int(summed) // ranks
                start = time.perf_counter()
                for _ in range(calls):
                    group.allreduce([tensor]).wait()
                times[rank, nbytes] = (time.perf_counter() - start) / calls

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        few, many = self.LINK_BYTES
        small, large = (max(times[r, n] for r in range(ranks)) for n in self.LINK_BYTES)
        ring = 2 * (ranks - 1) / ranks  # the bytes each rank sends per byte reduced
        gbps = ring * (many - few) / max(large - small, 1e-9) / 1e9
        return max(small - ring * few / (gbps * 1e9), 0.0), gbps

    def gemm_seconds(self, m: int, k: int, n: int) -> float:
        """Seconds for an m×k @ k×n fp32 matmul, timed at a capped size and scaled by FLOPs."""
        if not m * k * n:
            return 0.0
        cap = self.GEMM_CAP
        return 2 * m * k * n / (self.gemm_tflops(min(m, cap), min(k, cap), min(n, cap)) * 1e12)

    def block_seconds(self, model, tp: int, micro_batch: int, seq_len: int, moe: bool) -> float:
        """Forward and backward of one of Keel's blocks at this rank's tensor-parallel shard: GEMMs, norms,
        RoPE, attention, SwiGLU and the framework's per-op cost together (at a small width the GEMMs are a
        minority). Timed on up to BLOCK_TOKENS tokens (whole sequences where they fit), scaled by tokens."""
        import torch

        from keel.model.llama import Block
        from keel.model.router import is_moe_block
        from keel.parallel import comm
        from keel.parallel.layer_parallel import EPContext, LayerParallel
        from keel.parallel.tensor import TPContext

        seq = min(seq_len, self.BLOCK_TOKENS)
        batch = max(1, min(micro_batch, self.BLOCK_TOKENS // seq))
        key = (repr(model), tp, batch, seq, moe)
        if key not in self._blocks:
            layer_id = next(i for i in range(model.n_layers) if is_moe_block(model, i) == moe)
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
            self._blocks[key] = best
        return self._blocks[key] * micro_batch * seq_len / (batch * seq)
