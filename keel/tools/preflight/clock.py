"""Clock offsets against rank 0, NTP-style, through two world collectives per round.

Log timestamps, the straggler monitor and "who arrived late" all compare wall clocks across nodes, so a skewed
node misleads all of them. Each round rank 0 broadcasts its send time s0; every rank notes its receive time
r_i, then sends (r_i, t_i) back in an all-gather that rank 0 sees complete at time e. With forward delay
f = r_i - s0 = d1 + θ_i and backward delay b = e - t_i = d2 - θ_i, the offset is θ_i ≈ (f - b) / 2, exact when the
delays are symmetric and off by at most (f + b) / 2 otherwise; the round with the smallest f + b is kept. Two
small collectives per round, whatever the world size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from keel.parallel import comm

ROUNDS = 8


@dataclass(frozen=True)
class Clock:
    """This rank's wall clock; `skew_s` is the fault injection's (faults.preflight_clock_skew_s)."""

    skew_s: float = 0.0

    def now(self) -> float:
        return time.time() + self.skew_s


@dataclass(frozen=True)
class ClockOffset:
    offset_s: float  # this rank's clock minus rank 0's
    uncertainty_s: float  # half the best round trip: the offset is right within this


def measure_offsets(clock: Clock, world: comm.Group, rounds: int = ROUNDS) -> list[ClockOffset]:
    """Every rank's offset against rank 0 (the same list on every rank)."""
    n = world.size
    best = torch.full((n,), float("inf"), dtype=torch.float64)
    offset = torch.zeros(n, dtype=torch.float64)
    for _ in range(rounds):
        sent = torch.tensor([clock.now()], dtype=torch.float64)
        comm.broadcast(sent, world)
        received = clock.now()
        stamps = comm.all_gather(torch.tensor([received, clock.now()], dtype=torch.float64), world)
        done = clock.now()
        if world.rank != 0:
            continue
        for i, pair in enumerate(stamps):
            forward = pair[0].item() - sent.item()
            backward = done - pair[1].item()
            if forward + backward < best[i]:
                best[i] = forward + backward
                offset[i] = (forward - backward) / 2
    best[0], offset[0] = (
        0.0,
        0.0,
    )  # rank 0 against itself: none (its round trips include waiting for the others)
    result = torch.stack([offset, best / 2])
    comm.broadcast(result, world)
    return [ClockOffset(float(o), float(u)) for o, u in zip(result[0], result[1])]
