"""What the run needs (keel/engine/memory_model.py) and what each rank's host and device have.

The memory model predicts a rank's parameters, gradients, optimizer state, buckets and the activations of the
micro-batches it holds in flight (keel/engine/activations.py): a rank whose free memory is below that cannot
train, and one close to it (judge.py's margin: allocator fragmentation, the framework's own buffers) likely
cannot. On CPU the state lives in host memory, shared by
the ranks of one host; on CUDA it lives on the device and the host's figure is reported only.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import psutil
import torch

from keel.config import RunConfig
from keel.engine.ds_config import precision, zero_stage
from keel.engine.memory_model import BYTES, Layout, estimate, param_share
from keel.run_dir import node_name


@dataclass(frozen=True)
class RunNeeds:
    # one rank's params + grads + optimizer + buckets + activations in flight (the largest pipeline rank's)
    rank_state_bytes: int
    checkpoint_bytes: int  # one whole checkpoint, all ranks' files together
    keep_last: int
    # one rank's host memory beside the device state: an async save's snapshot and in-memory snapshots
    host_bytes: int = 0
    snapshot_bytes: int = (
        0  # of which in checkpoint.memory_dir (a tmpfs): in-memory snapshots at their peak
    )


@dataclass(frozen=True)
class MemoryResult:
    host: str
    host_available_bytes: int
    device_free_bytes: int  # -1 on CPU
    memory_dir_free_bytes: int = (
        -1
    )  # checkpoint.memory_dir's free space (-1: no in-memory snapshots)


def run_needs(cfg: RunConfig, ds: dict, world_size: int) -> RunNeeds:
    parallel = cfg.parallel
    dp = world_size // (parallel.tp * parallel.pp * parallel.cp * parallel.sp)
    layout = Layout(
        tp=parallel.tp, pp=parallel.pp, dp=dp, ep=parallel.ep, sp=parallel.sp, cp=parallel.cp
    )
    memory = estimate(cfg, ds, layout)
    return RunNeeds(
        memory.working,
        checkpoint_bytes(cfg, ds),
        cfg.checkpoint.keep_last,
        memory.host + memory.snapshots,
        memory.snapshots,
    )


def checkpoint_bytes(cfg: RunConfig, ds: dict) -> int:
    """The module's weights at the run's precision plus Adam's two fp32 moments, plus the fp32 master copy a
    ZeRO optimizer (or 16-bit training) keeps: what DeepSpeed's model and optimizer files hold, summed over ranks."""
    prec, stage = precision(ds), zero_stage(ds)
    master = 4 if (prec != "fp32" or stage >= 1) else 0
    return param_share(cfg.model, Layout(), cfg.parallel.pipeline_partition).total * (
        BYTES[prec] + 8 + master
    )


def measure_memory(device: str, memory_dir: str = "") -> MemoryResult:
    """This rank's host and device free memory, and `memory_dir`'s free space when snapshots go there."""
    device_free = torch.cuda.mem_get_info()[0] if device == "cuda" else -1
    tmpfs_free = -1
    if memory_dir:
        usage = shutil.disk_usage(memory_dir) if os.path.isdir(memory_dir) else None
        tmpfs_free = usage.free if usage else 0
    return MemoryResult(
        node_name(), int(psutil.virtual_memory().available), int(device_free), tmpfs_free
    )
