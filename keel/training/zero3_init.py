"""ZeRO-3's placement: layers built under `deepspeed.zero.Init`, initialised one gathered parameter at a time.

Under `zero.Init` every module's parameters are partitioned over the data-parallel group as soon as the module is
constructed, so construction never holds more than one module's parameters beyond this rank's partitions. Init
then gathers one parameter (`GatheredParameters`, bounded by the largest parameter), fills it on the modifier
rank and lets DeepSpeed broadcast and re-partition it — the values are the same as every other placement's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from keel.model.materialize import Placement
from keel.parallel.topology import Topology

T = TypeVar("T")


class ZeRO3Placement(Placement):
    """Build under `deepspeed.zero.Init` with the run's DeepSpeed JSON and data-parallel group."""

    def __init__(self, ds: dict[str, Any], topology: Topology, dtype: torch.dtype) -> None:
        from deepspeed.accelerator import get_accelerator

        super().__init__(get_accelerator().current_device_name(), dtype)
        self.ds = ds
        self.mpu = topology if topology.shape.world_size > 1 else None  # the groups build_engine hands DeepSpeed

    def build(self, construct: Callable[[], T]) -> T:
        import deepspeed

        # dtype=None: zero.Init then takes it from the config (the same one `self.dtype` was derived from). An
        # explicit dtype is misread in DeepSpeed 0.19.8 where the accelerator lacks fp16 (CPU): `dtype or fp16 if
        # fp16_supported() else bf16 if is_bf16_supported else fp32` (a method, not a call) gives bf16 always.
        with deepspeed.zero.Init(config_dict_or_path=self.ds, mpu=self.mpu, dtype=None):
            return construct()

    def gather(self, param: nn.Parameter) -> contextlib.AbstractContextManager:
        import deepspeed

        return deepspeed.zero.GatheredParameters([param], modifier_rank=0)
