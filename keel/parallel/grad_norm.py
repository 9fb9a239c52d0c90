"""The global gradient norm with every parameter counted exactly once across the model-parallel group.

DeepSpeed computes this itself for ZeRO and mixed precision (reading `tensor_model_parallel` to tell shards
from replicas); its plain fp32 ZeRO-0 path clips without recording the norm, and its generic helper counts a
TP-replicated parameter once per TP rank. This is Megatron's rule: shards count on every rank, replicas only
on TP rank 0, and the squares are summed over the model-parallel group.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from keel.parallel.topology import Topology


def global_grad_norm(params: Iterable[torch.nn.Parameter], topology: Topology) -> float:
    tp_rank0 = topology.rank_in("tp") == 0
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        if getattr(p, "tensor_model_parallel", False) or tp_rank0:
            total += p.grad.detach().double().pow(2).sum()
    group = topology.group("model")
    if topology.size("model") > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt().item()
