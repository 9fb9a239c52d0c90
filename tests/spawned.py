"""Spawned worlds for tests: ranks forked from one forkserver that imported torch, DeepSpeed and Keel once.

A spawned rank otherwise pays ~3 s of CPU before its first line (torch, DeepSpeed, and torch._dynamo, which the
first optimizer imports); on 2 cores that is most of a small world's cost. The forkserver is one clean
single-threaded process per pytest worker: forking from it is as safe as spawn. Its preload list is fixed when it
starts, so every test starts its worlds here, with the same list.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch._dynamo", "deepspeed", "keel.engine.build", "keel.training.entry"]


def start_world(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """Run `fn(rank, *args)` on `nprocs` ranks and wait for all of them (a rank's exception fails the test)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def rank_env(rank: int, world: int, port: int) -> None:
    """The environment torch's and DeepSpeed's initialisation read, for rank `rank` of a local world of `world`."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
