"""The cross-rank loss check in O(1) bytes per rank (keel/training/guards/consistency.py `LossOutlierCheck`).

Each rank of a world runs the check in a thread of its own, over a stand-in for the world's control channel that
reduces what the threads send: the statistics and the keyed extremes every rank receives are what a real
all-reduce would give. The real 4-rank run with a noisy rank is tests/test_stability.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from keel.parallel import comm
from keel.parallel.topology import GridShape, Topology
from keel.training.guards import consistency
from keel.training.guards.consistency import LossOutlierCheck


class ThreadWorld:
    """`world` ranks as threads; `all_reduce` and `broadcast_object` meet at a barrier."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list = [None] * world
        self.sent: list[int] = [0] * world  # bytes each rank sent, over all collectives

    def all_reduce(self, tensor: torch.Tensor, group: comm.Group, op: str = "sum") -> torch.Tensor:
        self.sent[group.rank] += tensor.numel() * tensor.element_size()
        self.slots[group.rank] = tensor.clone()
        self.barrier.wait()
        stacked = torch.stack(self.slots)
        out = stacked.sum(0) if op == "sum" else stacked.max(0).values
        self.barrier.wait()
        return out

    def broadcast_object(self, obj, group: comm.Group, src: int = 0):
        self.slots[group.rank] = obj
        self.barrier.wait()
        out = self.slots[src]
        self.barrier.wait()
        return out

    def run(self, shape: GridShape, losses: list[float | None], checks: int, monkeypatch):
        """Every rank's events after `checks` checks of the same `losses`."""
        monkeypatch.setattr(comm, "all_reduce", self.all_reduce)
        monkeypatch.setattr(comm, "broadcast_object", self.broadcast_object)
        monkeypatch.setattr(consistency, "node_name", lambda: f"host{threading.get_ident()}")
        events: list = [None] * self.world
        hosts: list = [None] * self.world

        def rank(r: int) -> None:
            # no process group: every handle is the world's index r without a torch group (the stand-in reduces)
            topology = Topology(shape, r)
            hosts[r] = f"host{threading.get_ident()}"
            check = LossOutlierCheck(topology, sigmas=3.0, repeats=2)
            for _ in range(checks):
                events[r] = check.check(losses[r])

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return events, hosts


def _losses(shape: GridShape, replica_loss) -> list[float | None]:
    """The loss each rank holds: every rank of replica d (tp and sp ranks alike) holds replica_loss(d)."""
    return [
        replica_loss(shape.coords(r)["edp"] * shape.ep + shape.coords(r)["ep"])
        for r in range(shape.world_size)
    ]


@pytest.mark.parametrize(
    "shape", [GridShape(8), GridShape(8, tp=2), GridShape(16, tp=2, ep=2)], ids=str
)
@pytest.mark.parametrize("odd", [0, 2])
def test_the_noisy_replica_is_flagged_with_its_rank_and_host(shape, odd, monkeypatch):
    losses = _losses(shape, lambda d: 9.0 if d == odd else 4.0 + 0.01 * d)
    world = ThreadWorld(shape.world_size)
    events, hosts = world.run(shape, losses, checks=2, monkeypatch=monkeypatch)
    assert all(e == events[0] for e in events)  # identical on every rank
    [event] = events[0]
    flagged = min(
        r for r in range(shape.world_size) if losses[r] == 9.0
    )  # tp rank 0 of the replica
    assert event["dp_rank"] == odd and event["flagged_rank"] == flagged
    assert event["host"] == hosts[flagged] and event["consecutive"] == 2
    assert event["loss"] == pytest.approx(9.0) and event["sigmas"] > 3
    others = [4.0 + 0.01 * d for d in range(shape.dp) if d != odd]
    assert event["others_mean"] == pytest.approx(sum(others) / len(others))


def test_one_noisy_check_is_not_a_streak_and_a_quiet_world_flags_nothing(monkeypatch):
    shape = GridShape(8)
    noisy = _losses(shape, lambda d: 9.0 if d == 5 else 4.0 + 0.01 * d)
    events, _ = ThreadWorld(8).run(shape, noisy, checks=1, monkeypatch=monkeypatch)
    assert events == [[]] * 8  # repeats=2
    quiet = _losses(shape, lambda d: 4.0 + 0.01 * d)
    events, _ = ThreadWorld(8).run(shape, quiet, checks=3, monkeypatch=monkeypatch)
    assert events == [[]] * 8


def test_bytes_per_rank_do_not_grow_with_the_world(monkeypatch):
    sent = {}
    for world_size in (8, 32):
        shape = GridShape(world_size)
        world = ThreadWorld(world_size)
        world.run(
            shape, _losses(shape, lambda d: 4.0 + 0.01 * d), checks=1, monkeypatch=monkeypatch
        )
        sent[world_size] = set(world.sent)
    assert sent[8] == sent[32] == {40}  # a count, a sum and a sum of squares; two keyed extremes


def test_the_key_orders_as_the_floats_do():
    values = [-1e39, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 4.0, 4.0001, 1e39]
    keys = [consistency._ordered(v) for v in values]
    assert keys == sorted(keys) and all(0 < k < 2**32 for k in keys)
    assert consistency._float_of(consistency._ordered(-3.5)) == -3.5
