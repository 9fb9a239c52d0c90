"""Ulysses sequence parallelism (DeepSpeed-Ulysses): the sequence is sharded over the sp group everywhere except
inside attention, where an all-to-all trades sequence shards for head shards and back.

Every sp rank of a data-parallel replica reads the same samples; the embedding keeps this rank's sequence chunk
of the tokens and the loss its chunk of the labels. Attention runs through DeepSpeed's `DistributedAttention`
(q, k, v: [b, s/sp, heads, d] → [b, s, heads/sp, d]; the output back), with RoPE applied after the exchange, on
full-sequence positions. Everything else is position-wise and needs no communication.

Gradients: each sp rank backpropagates its chunk's mean loss divided by sp, and DeepSpeed sums gradients over the
sequence-data-parallel group and divides by dp (its Ulysses convention), which gives the full-sequence mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keel.parallel import comm

SEQ_DIM = 1


@dataclass(frozen=True)
class SPContext:
    group: comm.Group | None = None  # the sp group's device channel
    rank: int = 0
    size: int = 1

    @classmethod
    def from_topology(cls, topology, name: str = "sp") -> SPContext:
        """The Ulysses group (`sp`), or every rank splitting one sequence (`seq`: cp × sp)."""
        if topology is None or topology.size(name) == 1:
            return cls()
        return cls(topology.device(name), topology.rank_in(name), topology.size(name))


def sequence_chunk(x: torch.Tensor, sp: SPContext) -> torch.Tensor:
    """This rank's chunk of a [b, s, ...] tensor every sp rank holds in full (token ids, labels)."""
    return x if sp.size == 1 else x.chunk(sp.size, dim=SEQ_DIM)[sp.rank].contiguous()


class _SequenceMean(torch.autograd.Function):
    """Over the ranks splitting a sequence (`seq`: Ulysses sp × context-parallel cp, each an equal share of its
    tokens). Forward: the mean of the sp ranks' chunk losses (the full-sequence loss, on every rank).
    Backward: each rank's chunk loss gets 1/sp where DeepSpeed sums the sp ranks' gradients (the plain engine's
    sequence-data-parallel reduction divides by dp alone), 1 where it averages them (the pipeline engine, whose
    data axis holds the sp ranks: keel/engine/pipeline.py)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, sp: SPContext, engine_averages_sp: bool) -> torch.Tensor:
        ctx.size = 1 if engine_averages_sp else sp.size
        total = loss.detach().clone()
        comm.all_reduce(total, sp.group)
        return total / sp.size

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.size, None, None


def sequence_mean(
    loss: torch.Tensor, sp: SPContext, engine_averages_sp: bool = False
) -> torch.Tensor:
    return loss if sp.size == 1 else _SequenceMean.apply(loss, sp, engine_averages_sp)


def ulysses_attention(attend, sp: SPContext):
    """Wrap `attend(q, k, v)` (layout [b, s, heads, d]) so it sees the whole sequence and heads / sp."""
    # ~1.5 s: a model without Ulysses never needs it
    from deepspeed.sequence.layer import (
        DistributedAttention,
    )

    return DistributedAttention(attend, sp.group.handle, scatter_idx=2, gather_idx=SEQ_DIM)
