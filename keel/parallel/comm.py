"""Every collective Keel issues itself, each on an explicit channel.

At scale a collective hangs when its ranks disagree: one rank enters an all-reduce the others never reach, or
ranks of one group enter it on different devices (under `cpu:gloo,cuda:nccl` a CPU tensor goes to gloo and a
CUDA tensor to NCCL: two different collectives, a hang). So Keel never calls `torch.distributed` collectives
directly (tests/test_comm_rule.py fails on any that does); it calls the functions here with a `Group` handle
that names the channel:

- `device`: tensors on the engine's device, over the group's device backend (NCCL on GPUs) — activations,
  gradients, norms, anything already on the device.
- `control`: CPU tensors and Python objects over the group's CPU backend (gloo) — decisions, flags, host
  names, timestamps.

A tensor on the wrong device for its channel is an error here, on every rank that makes it, instead of a hang
on some. Handles come from `Topology.comm(name, channel)`. With `logging.collective_trace: true` every call is
also recorded (op, group, ranks, channel, dtype, numel) in `RUN_DIR/collectives/trace_rank<R>.jsonl`, which
tests/test_collective_trace.py compares across ranks (and which shows where ranks parted ways after a hang).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DEVICE = "device"
CONTROL = "control"
CHANNELS = (DEVICE, CONTROL)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class CollectiveTrace:
    """Append-only record of one rank's collectives, one JSON line each (only when tracing is asked for)."""

    def __init__(self, directory: Path, rank: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"trace_rank{rank}.jsonl"
        self._file = self.path.open("a", buffering=1)

    def record(
        self, op: str, group: Group, tensor: torch.Tensor | None, numel: int | None = None
    ) -> None:
        """`numel`: what every rank must agree on, when not the tensor's size (an uneven all-to-all's row)."""
        entry = {
            "op": op,
            "group": group.name,
            "ranks": list(group.ranks),
            "channel": group.channel,
            "dtype": str(tensor.dtype).removeprefix("torch.") if tensor is not None else "object",
            "numel": numel if numel is not None else tensor.numel() if tensor is not None else 0,
            "device": tensor.device.type if tensor is not None else "cpu",
        }
        self._file.write(json.dumps(entry) + "\n")


@dataclass(frozen=True, eq=False)
class Group:
    """One named process group seen through one channel: what a collective needs, and what a trace records."""

    name: str
    ranks: tuple[int, ...]
    rank: int  # this process's index in `ranks`
    channel: str
    handle: Any = None  # the torch ProcessGroup; None: the default (world) group
    device_type: str = "cpu"  # the device the `device` channel's backend serves ("cuda" under NCCL)
    trace: CollectiveTrace | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def active(self) -> bool:
        """False for a group of one (or no process group at all): every collective is then the identity."""
        return self.size > 1 and dist.is_available() and dist.is_initialized()

    def expects(self) -> str:
        return "cpu" if self.channel == CONTROL else self.device_type


def single(name: str = "world", channel: str = DEVICE) -> Group:
    """The handle layers use outside any process group (one process): every collective is the identity."""
    return Group(name, (0,), 0, channel)


def world_control() -> Group:
    """The world's control channel before a Topology exists (the launcher's verdict broadcast)."""
    if not (dist.is_available() and dist.is_initialized()):
        return single(channel=CONTROL)
    return Group("world", tuple(range(dist.get_world_size())), dist.get_rank(), CONTROL)


def check(op: str, group: Group, tensor: torch.Tensor | None) -> None:
    """Raise if `tensor` (None: Python objects) does not belong on `group`'s channel."""
    if tensor is not None and tensor.device.type != group.expects():
        raise RuntimeError(
            f"{op} on the {group.channel} channel of group {group.name!r} needs a "
            f"{group.expects()} tensor, got one on {tensor.device}: move it (or use the "
            f"{CONTROL if group.channel == DEVICE else DEVICE} channel) — mixing devices in one "
            "collective hangs under NCCL"
        )
    if tensor is None and group.channel != CONTROL:
        raise RuntimeError(
            f"{op} of Python objects belongs on the {CONTROL} channel (group {group.name!r})"
        )


def _enter(op: str, group: Group, tensor: torch.Tensor | None, numel: int | None = None) -> None:
    check(op, group, tensor)
    if group.trace is not None:
        group.trace.record(op, group, tensor, numel)


# -- tensors ---------------------------------------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """In place over `group`; returns `tensor`."""
    if group.active:
        _enter(f"all_reduce_{op}", group, tensor)
        dist.all_reduce(tensor, op=_OPS[op], group=group.handle)
    return tensor


def all_gather(tensor: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on all ranks), in group order."""
    if not group.active:
        return [tensor]
    _enter("all_gather", group, tensor)
    parts = [torch.empty_like(tensor) for _ in range(group.size)]
    dist.all_gather(parts, tensor.contiguous(), group=group.handle)
    return parts


def reduce_scatter(parts: list[torch.Tensor], group: Group) -> torch.Tensor:
    """Sum of every rank's `parts[r]`, delivered to rank r."""
    if not group.active:
        return parts[0]
    _enter("reduce_scatter", group, parts[0])
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, [p.contiguous() for p in parts], group=group.handle)
    return out


def all_to_all(
    tensor: torch.Tensor,
    group: Group,
    send_splits: list[int] | None = None,
    recv_splits: list[int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of `tensor` split by `send_splits` go to each peer; returns the rows received (`recv_splits`)."""
    if not group.active:
        return tensor if out is None else out.copy_(tensor)
    # ranks agree on the row size, not the rows
    uneven = send_splits is not None or recv_splits is not None
    _enter(
        "all_to_all_uneven" if uneven else "all_to_all",
        group,
        tensor,
        math.prod(tensor.shape[1:]) if uneven else None,
    )
    if out is None:
        rows = sum(recv_splits) if recv_splits is not None else tensor.shape[0]
        out = tensor.new_empty((rows, *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), recv_splits, send_splits, group=group.handle)
    return out


def broadcast(tensor: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """In place from the group's `src`-th rank (an index into `group.ranks`)."""
    if group.active:
        _enter("broadcast", group, tensor)
        dist.broadcast(tensor, src=group.ranks[src], group=group.handle)
    return tensor


# -- Python objects and synchronization (control channel only) ----------------------------------------------------
def all_gather_object(obj: Any, group: Group) -> list[Any]:
    if not group.active:
        return [obj]
    _enter("all_gather_object", group, None)
    gathered: list[Any] = [None] * group.size
    dist.all_gather_object(gathered, obj, group=group.handle)
    return gathered


def gather_object(obj: Any, group: Group, dst: int = 0) -> list[Any] | None:
    """Every rank's `obj`, in group order, on the group's `dst`-th rank; None on the others. What only one rank
    reads: an all-gather would hand every rank every rank's object (O(world) bytes each)."""
    if not group.active:
        return [obj]
    _enter("gather_object", group, None)
    gathered: list[Any] | None = [None] * group.size if group.rank == dst else None
    dist.gather_object(obj, gathered, dst=group.ranks[dst], group=group.handle)
    return gathered


def scatter_object(objs: list[Any] | None, group: Group, src: int = 0) -> Any:
    """The `src`-th rank's `objs[i]` on the group's i-th rank (`objs` is read on `src` only): a plan with one entry
    per rank, O(world) bytes in all rather than a broadcast's O(world) on every rank."""
    if not group.active:
        return objs[0] if objs else None
    _enter("scatter_object", group, None)
    box: list[Any] = [None]
    dist.scatter_object_list(
        box, objs if group.rank == src else None, src=group.ranks[src], group=group.handle
    )
    return box[0]


def broadcast_object(obj: Any, group: Group, src: int = 0) -> Any:
    """`obj` from the group's `src`-th rank, on every rank."""
    if not group.active:
        return obj
    _enter("broadcast_object", group, None)
    box = [obj]
    dist.broadcast_object_list(box, src=group.ranks[src], group=group.handle)
    return box[0]


def barrier(group: Group) -> None:
    if group.active:
        _enter("barrier", group, None)
        dist.barrier(group=group.handle)


# -- a ring: every rank sends to the next and receives from the previous (context parallel's K/V) -----------------
class RingShift:
    """The tensors arriving from the previous rank of the ring; `wait()` before reading them."""

    def __init__(self, received: list[torch.Tensor], works: list, sending: list | None = None):
        self.received = received
        self._works = works
        self._sending = sending  # the send buffers, alive until the transfer is done

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works, self._sending = [], None
        return self.received


def ring_shift(tensors: list[torch.Tensor], group: Group) -> RingShift:
    """Start sending `tensors` to the group's next rank and receiving the previous rank's (same shapes) into new
    buffers; returns at once, so the caller computes while they travel. A collective in all but name (every rank
    of the group does the same, in the same order), so it is traced as one: `ring_shift` with the total numel.
    The tensors must stay unmodified until `wait()`."""
    if not group.active:
        return RingShift([t for t in tensors], [])
    for tensor in tensors:
        _enter("ring_shift", group, tensor)
    nxt = group.ranks[(group.rank + 1) % group.size]
    prev = group.ranks[(group.rank - 1) % group.size]
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group=group.handle) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prev, group=group.handle) for r in received]
    return RingShift(received, list(dist.batch_isend_irecv(ops)), ops)


# -- pipeline point-to-point (pairs of ranks, not collectives) ----------------------------------------------------
def post_p2p(ops: list) -> list:
    """Post DeepSpeed `P2POp`s (`deepspeed.comm`) as one batch and return its works, without waiting.

    For the interleaved pipeline engine (keel/engine/interleaved_engine.py). Not traced: a rank's
    sends and receives differ from its peers' by design, so the same-collectives comparison does not apply; the
    pairing that keeps them hang-free (both ends post a transfer in the same batch) is proven by
    tests/test_interleaved_schedule.py. Activations and gradients only: every tensor must be on one device type.
    """
    # ~1.5 s: every Topology imports comm, config checks included
    from deepspeed import (
        comm as ds_comm,
    )

    devices = {op.tensor.device.type for op in ops}
    if len(devices) > 1:
        raise RuntimeError(
            f"pipeline p2p batch mixes devices {sorted(devices)}: one batch goes to one backend"
        )
    return list(ds_comm.batch_isend_irecv(ops))


# -- bytes between two ranks, on CPU (in-memory checkpoints: keel/training/checkpoint/memory.py) --------------------
def post_send(tensor: torch.Tensor, to: int, handle: Any) -> Any:
    """Start sending CPU `tensor` to global rank `to` over the process group `handle`; returns the work. Not traced,
    as pipeline point-to-point is not: a rank's sends differ from its peers' by design (each pair posts both ends;
    the in-memory snapshot exchange and its restore plan pair them)."""
    if tensor.device.type != "cpu":
        raise RuntimeError(f"post_send takes a CPU tensor, got one on {tensor.device}")
    return dist.isend(tensor, to, group=handle)


def post_recv(tensor: torch.Tensor, source: int, handle: Any) -> Any:
    """Start receiving into CPU `tensor` from global rank `source` over `handle`; returns the work."""
    if tensor.device.type != "cpu":
        raise RuntimeError(f"post_recv takes a CPU tensor, got one on {tensor.device}")
    return dist.irecv(tensor, source, group=handle)
