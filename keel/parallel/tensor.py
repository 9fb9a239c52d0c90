"""Megatron tensor parallelism: the conjugate communication functions and the sharded layers.

A transformer sub-block (attention or MLP) is one *tensor-parallel region*: its input enters through `enter`
(identity forward / all-reduce backward — or, under sequence parallelism, all-gather along the sequence /
reduce-scatter backward), its column-parallel projections produce head- or hidden-sharded activations, and its
row-parallel projection's partial sums leave through `exit` (all-reduce — or reduce-scatter along the sequence).
Each region communicates once in each direction, whatever number of projections it holds.

Activations are [batch, seq, hidden]; the sequence dimension (1) is the one sequence parallelism shards.
With tp = 1 every function here is the identity and the layers are plain linears, so one code path serves all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from keel.parallel import comm, float8
from keel.parallel.float8 import Float8Spec
from keel.parallel.random import ShardedRNG

SEQ_DIM = 1


@dataclass(frozen=True)
class TPContext:
    """What a tensor-parallel layer needs to know: its group, its place in it, and whether SP is on."""

    group: comm.Group | None = None  # the tp group's device channel
    rank: int = 0
    size: int = 1
    sequence_parallel: bool = False
    # dropout stream for sequence-parallel (per-rank) activations
    sharded_rng: ShardedRNG | None = None

    @classmethod
    def from_topology(cls, topology, sequence_parallel: bool = False, seed: int = 0) -> TPContext:
        if topology is None or topology.size("tp") == 1:
            return cls()
        rank = topology.rank_in("tp")
        rng = ShardedRNG(seed, rank) if sequence_parallel else None
        return cls(topology.device("tp"), rank, topology.size("tp"), sequence_parallel, rng)


# -- the communication primitives, each a pair of conjugate operations ----------------------------------------
def _all_reduce(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    return comm.all_reduce(x.contiguous(), group)


def _gather_seq(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    return torch.cat(comm.all_gather(x, ctx.group), dim=SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    return comm.reduce_scatter(list(x.chunk(ctx.size, dim=SEQ_DIM)), ctx.group)


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: sum the partial gradients of all TP ranks."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: sum the partial outputs of all TP ranks. Backward: identity."""

    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x, tp.group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather the sequence shards. Backward: reduce-scatter (consumers' grads are partial sums)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.tp), None


class _ReduceScatterSequence(torch.autograd.Function):
    """Forward: sum partial outputs and keep this rank's sequence shard. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.tp), None


class _ScatterSequence(torch.autograd.Function):
    """Forward: keep this rank's sequence shard of a replicated tensor. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.chunk(tp.size, dim=SEQ_DIM)[tp.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.tp), None


def enter(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Into a TP region: replicated input (all-reduce its grad), or gather the SP sequence shards."""
    if tp.size == 1:
        return x
    return _GatherSequence.apply(x, tp) if tp.sequence_parallel else _CopyToRegion.apply(x, tp)


def exit(y: torch.Tensor, tp: TPContext) -> torch.Tensor:  # noqa: A001 - the conjugate of enter
    """Out of a TP region: sum partial outputs (all-reduce), or reduce-scatter them into SP sequence shards."""
    if tp.size == 1:
        return y
    return (
        _ReduceScatterSequence.apply(y, tp)
        if tp.sequence_parallel
        else _ReduceFromRegion.apply(y, tp)
    )


def scatter_sequence(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """A replicated [b, s, ...] tensor → this rank's sequence shard (identity without SP)."""
    if tp.size == 1 or not tp.sequence_parallel:
        return x
    return _ScatterSequence.apply(x, tp)


def sum_grad_over_tp(param: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Use a TP-replicated parameter whose per-rank gradient is partial (SP norms, replicated kv heads).

    Summing in backward, before the gradient reaches the parameter, keeps the replicas identical under any
    ZeRO stage; without it they drift apart (a failure seen in public SP runs).
    """
    return param if tp.size == 1 else _CopyToRegion.apply(param, tp)


# -- sharded parameters --------------------------------------------------------------------------------------
def mark_sharded(param: nn.Parameter, dim: int, full_shape: tuple[int, ...], tp: TPContext) -> None:
    """Record how `param` is cut from its full tensor: init draws only this shard's blocks of it
    (keel/model/init.py), the gradient norm counts it on every TP rank (DeepSpeed reads `tensor_model_parallel`)."""
    param.tensor_model_parallel = tp.size > 1
    param.partition_dim = dim
    param.full_shape = tuple(full_shape)
    param.tp_rank, param.tp_size = tp.rank, tp.size


def _tp_group(tp: TPContext) -> comm.Group | None:
    return tp.group if tp.size > 1 else None


def _fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    fp8: Float8Spec | None,
    k: comm.Group | None = None,
    n: comm.Group | None = None,
    probe: torch.Tensor | None = None,
) -> torch.Tensor:
    """x Wᵀ in high precision, or in `fp8`'s recipe with the groups splitting W's input (`k`) or output (`n`)
    (`probe`: keel/parallel/float8.py `linear`)."""
    if fp8 is None:
        return F.linear(x, weight)
    return float8.linear(x, weight, fp8, k=k, n=n, probe=probe)


class ColumnParallelLinear(nn.Module):
    """y_shard = x W_shardᵀ with W split along its output rows; input must already be in the TP region.
    `fp8`: the GEMMs' low-precision recipe (None: the weight's dtype)."""

    def __init__(
        self, in_features: int, out_features: int, tp: TPContext, fp8: Float8Spec | None = None
    ) -> None:
        super().__init__()
        if out_features % tp.size:
            raise ValueError(
                f"column-parallel output size {out_features} is not divisible by tp={tp.size}"
            )
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features))
        mark_sharded(self.weight, 0, (out_features, in_features), tp)
        self.fp8, self.tp_group = fp8, _tp_group(tp)
        self.fp8_probe: torch.Tensor | None = None  # set by the monitor on its steps (FP8 health)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fp8_linear(x, self.weight, self.fp8, n=self.tp_group, probe=self.fp8_probe)


class FusedColumnParallelLinear(nn.Module):
    """Several column-parallel projections of one input as one GEMM (gate/up, k/v).

    The logical weight is [parts, out_features, in_features], the parts stacked on dim 0 and each one split
    along its output rows (partition dim 1), so rank r holds one contiguous [parts, out / tp, in] tensor: any
    tp dividing `out_features` works, the logical tensor (state-dict schema) is the same at every tp, and tp
    shards concatenate along dim 1 back into it. `part_names` are the projections' own names: init draws each
    part as the separate [out, in] tensor it fuses (keel/model/init.py), HF conversion maps part i to one HF
    projection. forward returns the parts' outputs, views of the one GEMM's result.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPContext,
        part_names: tuple[str, ...],
        fp8: Float8Spec | None = None,
    ) -> None:
        super().__init__()
        if out_features % tp.size:
            raise ValueError(
                f"column-parallel output size {out_features} is not divisible by tp={tp.size}"
            )
        self.weight = nn.Parameter(
            torch.empty(len(part_names), out_features // tp.size, in_features)
        )
        mark_sharded(self.weight, 1, (len(part_names), out_features, in_features), tp)
        self.weight.part_names = tuple(part_names)
        self.fp8, self.tp_group = fp8, _tp_group(tp)
        self.fp8_probe: torch.Tensor | None = None  # set by the monitor on its steps (FP8 health)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return fused_linear(x, self.weight, self.fp8, self.tp_group, self.fp8_probe)


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    fp8: Float8Spec | None = None,
    n: comm.Group | None = None,
    probe: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """x times each part of a stacked [parts, out, in] weight, as one GEMM; the outputs split its last dim.
    `n`: the group splitting the output rows (for `fp8`'s scales)."""
    parts = weight.shape[0]
    out = _fp8_linear(x, weight.reshape(-1, weight.shape[-1]), fp8, n=n, probe=probe)
    return out.chunk(parts, dim=-1)


class RowParallelLinear(nn.Module):
    """Partial y = x_shard W_shardᵀ with W split along its input columns; the caller `exit`s the region."""

    def __init__(
        self, in_features: int, out_features: int, tp: TPContext, fp8: Float8Spec | None = None
    ) -> None:
        super().__init__()
        if in_features % tp.size:
            raise ValueError(
                f"row-parallel input size {in_features} is not divisible by tp={tp.size}"
            )
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))
        mark_sharded(self.weight, 1, (out_features, in_features), tp)
        self.fp8, self.tp_group = fp8, _tp_group(tp)
        self.fp8_probe: torch.Tensor | None = None  # set by the monitor on its steps (FP8 health)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fp8_linear(x, self.weight, self.fp8, k=self.tp_group, probe=self.fp8_probe)


def padded_vocab_size(vocab_size: int, multiple: int, tp_size: int) -> int:
    """Vocab rounded up to a multiple of `multiple`×tp (Megatron's rule); padding ids are never targets."""
    step = multiple * tp_size
    return ((vocab_size + step - 1) // step) * step


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up the ids it owns and the region sums them.

    The forward returns this rank's *partial* embedding (zeros for ids it does not own); the caller exits the TP
    region (all-reduce, or reduce-scatter into sequence shards under SP).
    """

    def __init__(self, vocab_size: int, padded_size: int, dim: int, tp: TPContext) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.per_rank = padded_size // tp.size
        self.vocab_start = tp.rank * self.per_rank
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim))
        mark_sharded(self.weight, 0, (vocab_size, dim), tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)
