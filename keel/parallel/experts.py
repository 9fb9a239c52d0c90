"""Expert parallelism: a layer's experts sharded over the ep group, tokens exchanged with all-to-all.

Rank r of the ep group holds experts [r·E/ep, (r+1)·E/ep). Each rank routes its own tokens, sorts the (token,
expert) rows by expert, and sends each ep peer the rows for that peer's experts (`dispatch`); the peer runs its
experts and sends the outputs back along the same routes (`combine`). Splits are uneven in general: a dropless
layer sends exactly the rows it routed, so the split sizes are exchanged first (one all-to-all of E integers).

Expert parameters are distinct per ep rank and replicated over the expert-data-parallel (edp) group; they follow
DeepSpeed's MoE conventions (`allreduce = False`, `group_name`), so DeepSpeed reduces their gradients over edp
only and ZeRO partitions them there. `register_expert_groups` hands DeepSpeed Keel's ep/edp groups under that
name, so DeepSpeed never builds a second, differently-ordered grid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from keel.adapters import deepspeed_internals
from keel.parallel import comm


@dataclass(frozen=True)
class EPContext:
    """What an MoE layer needs to know about expert parallelism: its ep group, its place in it, and the group its
    expert parameters are replicated over (edp × Ulysses sp; DeepSpeed reduces and ZeRO partitions them there)."""

    group: comm.Group | None = None  # the ep group's device channel
    rank: int = 0
    size: int = 1
    ranks: tuple[int, ...] = (0,)
    edp_ranks: tuple[int, ...] = (0,)
    # torch's group of a kind ("ep", "expert_dp"), for DeepSpeed; asked only by MoE layers, as a group of one
    # rank (ep=1) is created on request (keel/parallel/process_groups.py)
    torch_group: Callable[[str], Any] | None = None

    @classmethod
    def from_topology(cls, topology) -> EPContext:
        if topology is None:
            return cls()
        return cls(
            topology.device("ep"),
            topology.rank_in("ep"),
            topology.size("ep"),
            tuple(topology.ranks("ep")),
            tuple(topology.ranks("expert_dp")),
            topology.group,
        )


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert groups of one ep size (`deepspeed.moe.layer.MoE.expert_group_name`)."""
    return f"ep_size_{ep_size}"


def mark_expert_param(param: torch.nn.Parameter, ep_size: int) -> None:
    """DeepSpeed's MoE marks: not all-reduced over the dense data-parallel group, but over its edp group."""
    param.allreduce = False
    param.group_name = expert_group_name(ep_size)


def register_expert_groups(ep: EPContext) -> None:
    """Give DeepSpeed this Topology's ep and edp groups under `expert_group_name(ep_size)`.

    DeepSpeed looks expert groups up by name in `deepspeed.utils.groups` (its gradient reduction, ZeRO's MoE
    param groups, MoE checkpoints); its own builder would derive them from a different rank order. Writing
    ours there is the seam DeepSpeed itself uses when a layer calls `set_deepspeed_parallelism`.
    """
    ep_group, edp_group = (
        (ep.torch_group("ep"), ep.torch_group("expert_dp")) if ep.torch_group else (None, None)
    )
    deepspeed_internals.register_expert_groups(
        expert_group_name(ep.size), ep_group, ep.ranks, edp_group, ep.edp_ranks
    )


class _AllToAll(torch.autograd.Function):
    """Rows [n, ...] split by `send` sizes go to each peer; `recv` sizes come back. Backward runs the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return comm.all_to_all(x, group, send, recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows."""
    return _AllToAll.apply(x, send, recv, group)


@dataclass
class Routes:
    """How rows travel in `dispatch`, so `combine` can send each output back to where its token lives. Built by
    `exchange_counts` from the layer's one host read of its routing counts."""

    send: list[int]  # rows this rank sends to each ep peer
    recv: list[int]  # rows this rank receives from each ep peer
    expert_counts: list[int]  # rows per local expert, in local-expert order (after the regrouping)
    # the same on the device (grouped GEMM offsets without a host-to-device copy)
    device_counts: torch.Tensor
    # [peer, local expert] received counts on the device (None: ep = 1)
    per_peer: torch.Tensor | None

    @property
    def sent_rows(self) -> int:
        return sum(self.send)


def exchange_counts(counts: torch.Tensor, ep: EPContext) -> Routes:
    """The split sizes of this layer's all-to-alls, from `counts[e]` (rows this rank routes to global expert e).

    The sizes must come to the host (the all-to-all needs them, as in every dropless implementation); this is the
    layer's one host read: this rank's counts and, under ep > 1, the counts its peers send it, read together.
    """
    if ep.size == 1:
        expert_counts = counts.tolist()
        return Routes([sum(expert_counts)], [sum(expert_counts)], expert_counts, counts, None)
    local = counts.numel() // ep.size
    per_peer = comm.all_to_all(counts, ep.group).view(ep.size, local)  # [peer, local expert]
    mine, theirs = torch.stack([counts.view(ep.size, local), per_peer]).tolist()
    return Routes(
        [sum(row) for row in mine],
        [sum(row) for row in theirs],
        [sum(column) for column in zip(*theirs)],
        per_peer.sum(0),
        per_peer,
    )


def dispatch(
    rows: torch.Tensor, routes: Routes, ep: EPContext
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Send expert-sorted `rows` to the ranks owning their experts, as `routes` (`exchange_counts`) says.

    Returns the rows this rank's experts must process, grouped by local expert, and the order that regrouped them
    (for `combine`; None under ep = 1, where nothing moves).
    """
    if ep.size == 1:
        return rows, None
    received = all_to_all(rows, routes.send, routes.recv, ep.group)
    # received rows are grouped by source peer, then by local expert: regroup by local expert. The output size is
    # known on the host, so repeat_interleave needs no second read of the counts.
    local = routes.per_peer.shape[1]
    expert_of_row = torch.repeat_interleave(
        torch.arange(local, device=rows.device).repeat(ep.size),
        routes.per_peer.flatten(),
        output_size=sum(routes.recv),
    )
    order = torch.argsort(expert_of_row, stable=True)
    return received[order], order


def combine(
    outputs: torch.Tensor, routes: Routes, order: torch.Tensor | None, ep: EPContext
) -> torch.Tensor:
    """The inverse of `dispatch`: expert outputs back to the rank and row order their tokens came from."""
    if ep.size == 1:
        return outputs
    return all_to_all(outputs[torch.argsort(order)], routes.recv, routes.send, ep.group)
