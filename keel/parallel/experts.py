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

from dataclasses import dataclass

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
    edp_group: object = None  # torch's group, for DeepSpeed
    edp_ranks: tuple[int, ...] = (0,)

    @classmethod
    def from_topology(cls, topology) -> EPContext:
        if topology is None:
            return cls()
        return cls(topology.device("ep"), topology.rank_in("ep"), topology.size("ep"), tuple(topology.ranks("ep")),
                   topology.group("expert_dp"), tuple(topology.ranks("expert_dp")))


NO_EP = EPContext()


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
    ep_handle = ep.group.handle if ep.group is not None else None
    deepspeed_internals.register_expert_groups(expert_group_name(ep.size), ep_handle, ep.ranks, ep.edp_group,
                                               ep.edp_ranks)


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
    """How rows travelled in `dispatch`, so `combine` can send each output back to where its token lives."""

    send: list[int]  # rows this rank sent to each ep peer
    recv: list[int]  # rows this rank received from each ep peer
    order: torch.Tensor | None  # local-expert row i is received row order[i] (None: no reordering needed)
    expert_counts: list[int]  # rows per local expert, in local-expert order


def dispatch(rows: torch.Tensor, counts: torch.Tensor, ep: EPContext) -> tuple[torch.Tensor, Routes]:
    """Send expert-sorted `rows` (`counts[e]` rows for global expert e) to the ranks owning the experts.

    Returns the rows this rank's experts must process, grouped by local expert, and the routes back. The
    split sizes come to the host (`tolist`): the all-to-all needs them, as in every dropless implementation.
    """
    local = counts.numel() // ep.size
    if ep.size == 1:
        return rows, Routes([rows.shape[0]], [rows.shape[0]], None, counts.tolist())
    received_counts = comm.all_to_all(counts, ep.group)  # [peer, local expert]
    send = counts.view(ep.size, local).sum(1).tolist()
    per_peer = received_counts.view(ep.size, local)
    recv = per_peer.sum(1).tolist()
    received = all_to_all(rows, send, recv, ep.group)
    # received rows are grouped by source peer, then by local expert: regroup by local expert
    expert_of_row = torch.repeat_interleave(torch.arange(local, device=counts.device).repeat(ep.size),
                                            per_peer.flatten())
    order = torch.argsort(expert_of_row, stable=True)
    return received[order], Routes(send, recv, order, per_peer.sum(0).tolist())


def combine(outputs: torch.Tensor, routes: Routes, ep: EPContext) -> torch.Tensor:
    """The inverse of `dispatch`: expert outputs back to the rank and row order their tokens came from."""
    if ep.size == 1:
        return outputs
    return all_to_all(outputs[torch.argsort(routes.order)], routes.recv, routes.send, ep.group)
