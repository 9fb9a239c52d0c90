"""Where a rank's layers are built: on the meta device, then materialized shard by shard on the target.

Layers are constructed on `torch.device("meta")` (shapes only, no storage), then every parameter gets empty
storage directly on the target device and dtype and `init_weights` fills it, so a rank never holds more than its
own shards plus one init block (keel/model/init.py). `Placement` is that policy; ZeRO-3 substitutes its own
(keel/engine/zero3_init.py): construction under `deepspeed.zero.Init`, each rank writing its own partitions.

Buffers built on meta come back as zeros: Keel's persistent buffers start at zero (the MoE balance bias) and its
caches are built lazily (RoPE); tests/test_init.py compares a meta-built model's buffers with an eagerly built one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")


class Placement:
    """Build layers on meta and materialize them on `device` in `dtype` (floating tensors only)."""

    def __init__(
        self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype

    def build(self, construct: Callable[[], T]) -> T:
        """Run `construct()` (returns a module or a list of modules) on meta, then materialize its result."""
        with torch.device("meta"):
            built = construct()
        materialize_(built if isinstance(built, list) else [built], self.device, self.dtype)
        return built

    def fill(
        self, param: nn.Parameter, write: Callable[[torch.Tensor, tuple[int, int] | None], None]
    ) -> None:
        """Have `write(out, flat)` set `param`'s value: `out` is the whole (tp-shard) tensor and `flat` None, or
        only this rank's window (start, end) of it flattened (ZeRO-3)."""
        write(param.data, None)


def _target_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if tensor.is_floating_point() else tensor.dtype


@torch.no_grad()
def materialize_(modules: Iterable[nn.Module], device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter and buffer of `modules` real (uninitialised / zero) storage on `device`.

    A Parameter shared by several modules (a tied head) is replaced by one new Parameter everywhere, and keeps
    the attributes Keel and DeepSpeed set on it (`full_shape`, `partition_dim`, `expert_id`, MoE marks, ...).
    """
    replaced: dict[int, nn.Parameter] = {}
    for root in modules:
        for module in root.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if not param.is_meta:
                    continue
                new = replaced.get(id(param))
                if new is None:
                    data = torch.empty(
                        param.shape, device=device, dtype=_target_dtype(param, dtype)
                    )
                    new = nn.Parameter(data, requires_grad=param.requires_grad)
                    new.__dict__.update(param.__dict__)
                    replaced[id(param)] = new
                setattr(module, name, new)
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.is_meta:
                    setattr(
                        module,
                        name,
                        torch.zeros(
                            buffer.shape, device=device, dtype=_target_dtype(buffer, dtype)
                        ),
                    )
