"""A rank's process start: its logging and the process group (gloo on CPU; NCCL for device tensors on GPUs)."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level, format=f"[keel r{rank}] %(message)s", stream=sys.stdout, force=True
    )
    # DeepSpeed calls torch collectives that torch has renamed; the warning is theirs to fix, not the user's.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    try:
        # DeepSpeed imports in ~1.5 s: `keel lr-find` imports this module before it checks its arguments
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
    except ImportError:
        pass


def init_distributed() -> None:
    """gloo on CPU, nccl (+ gloo for host tensors) on GPU; DeepSpeed's init reads RANK/WORLD_SIZE/MASTER_*."""
    import deepspeed  # ~1.5 s: `keel train` (external launcher) imports this module before it checks the config

    if dist.is_initialized():
        return
    # On GPUs, device tensors go through NCCL and the guards' small host-side tensors through gloo.
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
