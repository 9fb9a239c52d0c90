"""ZeRO-3's placement: layers built under `deepspeed.zero.Init`, each rank initialising its own partitions.

Under `zero.Init` every module's parameters are partitioned over the data-parallel group as soon as the module is
constructed, so construction never holds more than one module's parameters beyond this rank's partitions. Init
then writes each partition in place from the row blocks it covers (keel/model/init.py): no parameter is gathered
(`GatheredParameters` costs ~3× the parameter on gloo) and the values are every other placement's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn

from keel.adapters.deepspeed_internals import logical_shape, zero3_partition_window
from keel.model.materialize import Placement
from keel.parallel.topology import Topology

T = TypeVar("T")


class ZeRO3Placement(Placement):
    """Build under `deepspeed.zero.Init` with the run's DeepSpeed JSON and data-parallel group."""

    def __init__(self, ds: dict[str, Any], topology: Topology, dtype: torch.dtype) -> None:
        super().__init__(get_accelerator().current_device_name(), dtype)
        self.ds = ds
        # the groups build_engine hands DeepSpeed
        self.mpu = topology if topology.shape.world_size > 1 else None

    def build(self, construct: Callable[[], T]) -> T:
        # dtype=None: zero.Init then takes it from the config (the same one `self.dtype` was derived from). An
        # explicit dtype is misread in DeepSpeed 0.19.8 where the accelerator lacks fp16 (CPU): `dtype or fp16 if
        # fp16_supported() else bf16 if is_bf16_supported else fp32` (a method, not a call) gives bf16 always.
        # `mpu` only configures zero.Init's DeepSpeedConfig; the partitioning group is `data_parallel_group`, which
        # defaults to the whole world: at tp > 1 that splits each tp rank's shard across the tp ranks as well. The
        # engine shards over the mpu's sequence-data-parallel group (dp × sp; dp when sp = 1), so this must too.
        group = self.mpu.get_sequence_data_parallel_group() if self.mpu is not None else None
        with deepspeed.zero.Init(
            config_dict_or_path=self.ds, mpu=self.mpu, dtype=None, data_parallel_group=group
        ):
            return construct()

    def fill(
        self, param: nn.Parameter, write: Callable[[torch.Tensor, tuple[int, int] | None], None]
    ) -> None:
        """Write this rank's partition in place, from the row blocks it covers: no gather, no collective."""
        window = zero3_partition_window(param)
        if window is None:
            write(param.data, None)
            return
        part, start = window
        end = min(start + part.numel(), math.prod(logical_shape(param)))
        part.zero_()  # the last partition's padding past the parameter's end
        if end > start:
            write(part[: end - start], (start, end))
