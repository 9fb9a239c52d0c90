"""Collective bandwidth and latency per group kind of the run's Topology, and every rank pair's link.

Kinds: tp, sp, ep, dp and the world, each timed with all-reduce, all-gather and all-to-all at a few sizes; all
the disjoint groups of one kind run at once (as in training, where every tp group talks at the same time), so
a group is judged against its siblings under the same load. A kind whose groups are those of an earlier kind
(dp is the world when only data is parallel) is measured once. Links: rank pairs along a ring over the ranks and
between neighbouring pipeline stages, a few pairs at a time (no rank in two pairs of one round), each judged
against the best pair.

Per repetition every rank notes when it entered (its clock corrected by its offset to rank 0) and how long the
call took. The group's transfer time is the duration seen by the rank that entered last — it waited for nobody,
so a late rank does not pass for a slow link — and each rank's lateness is its entry minus the group's first
entry. Three small control reductions per kind and round turn these into per-group figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from keel.parallel import comm
from keel.parallel.topology import GROUP_AXES, WORLD, Topology

KINDS = ("tp", "sp", "ep", "dp", WORLD)
OPS = ("all_reduce", "all_gather", "all_to_all")
SIZES = (4 << 10, 256 << 10, 4 << 20)  # bytes per rank: latency, middle, bandwidth
PAIR_SIZES = (SIZES[0], SIZES[-1])
REPS = 5
LATE_FAULT_S = 0.02  # faults.preflight_slow_rank: this much late at every timed call
SLOW_LINK_FACTOR = 16  # faults.preflight_slow_link_rank: transfers through the rank carry this many times the bytes


@dataclass(frozen=True)
class Timing:
    """One group's figures for one op and size, as this rank saw them."""

    kind: str  # tp, sp, ep, dp, world, or "pair" / "pp" for links
    group: tuple[int, ...]
    op: str
    nbytes: int
    seconds: float  # median transfer time (the last-arriving rank's duration)
    late_s: float  # this rank's median lateness

    @property
    def bus_gbps(self) -> float:
        """Bus bandwidth in GB/s (nccl-tests' convention: comparable across ops and group sizes)."""
        n = len(self.group)
        factor = 2 * (n - 1) / n if self.op == "all_reduce" else (n - 1) / n
        return self.nbytes * factor / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class Injected:
    """The faults that shape this rank's timings (every rank knows them, so transfers still agree)."""

    late_rank: int = -1
    slow_link_rank: int = -1


def group_kinds(topology: Topology) -> list[tuple[str, list[list[int]]]]:
    """(label, the kind's groups) for every kind with groups of two or more ranks; a kind with the same groups
    as an earlier one is folded into its label ("dp=world")."""
    shape = topology.shape
    found: list[tuple[str, list[list[int]]]] = []
    for kind in KINDS:
        groups = (
            [list(range(shape.world_size))]
            if kind == WORLD
            else shape.groups_along(GROUP_AXES[kind])
        )
        if len(groups[0]) < 2:
            continue
        same = next((i for i, (_, g) in enumerate(found) if g == groups), None)
        if same is None:
            found.append((kind, groups))
        else:
            found[same] = (f"{found[same][0]}={kind}", groups)
    return found


def ring_pairs(world_size: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint rank pairs covering every edge of the ring 0-1-…-(n-1)-0."""
    if world_size < 2:
        return []
    edges = [(i, (i + 1) % world_size) for i in range(world_size if world_size > 2 else 1)]
    rounds: list[list[tuple[int, int]]] = [[], [], []]
    for i, (a, b) in enumerate(edges):
        odd_tail = world_size % 2 == 1 and i == len(edges) - 1 and world_size > 2
        rounds[2 if odd_tail else i % 2].append((min(a, b), max(a, b)))
    return [r for r in rounds if r]


def pipeline_pairs(topology: Topology) -> list[list[tuple[int, int]]]:
    """Rounds of (stage s, stage s+1) rank pairs with the other coordinates equal: the pipeline's p2p links."""
    shape = topology.shape
    rounds: list[list[tuple[int, int]]] = [[], []]
    for column in shape.groups_along(GROUP_AXES["pp"]):
        for s in range(len(column) - 1):
            rounds[s % 2].append((column[s], column[s + 1]))
    return [r for r in rounds if r]


def _payload(op: str, nbytes: int, n: int, scale: int, device: str) -> torch.Tensor:
    elements = max(n, nbytes // 4) * scale
    if op == "all_gather":
        elements = max(1, elements // n)  # nbytes is the gathered result
    elif op == "all_to_all":
        elements -= elements % n
        return torch.ones(n, elements // n, device=device)
    return torch.ones(elements, device=device)


def _call(op: str, tensor: torch.Tensor, group: comm.Group) -> None:
    if op == "all_reduce":
        comm.all_reduce(tensor, group)
    elif op == "all_gather":
        comm.all_gather(tensor, group)
    else:
        comm.all_to_all(tensor, group)


class Timer:
    """Times calls the way this module's docstring says: entries on the corrected clock, durations locally."""

    def __init__(self, now: Callable[[], float], rank: int, injected: Injected, device: str):
        self.now = now
        self.rank = rank
        self.injected = injected
        self.device = device

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time_group(
        self, kind: str, group: comm.Group, control: comm.Group, cases: list[tuple[str, int]]
    ) -> list[Timing]:
        """Every (op, nbytes) case on `group`, REPS times each after one warm-up; this rank's Timings."""
        scale = SLOW_LINK_FACTOR if self.injected.slow_link_rank in group.ranks else 1
        entries, durations = [], []
        for op, nbytes in cases:
            tensor = _payload(op, nbytes, group.size, scale, self.device)
            _call(op, tensor, group)
            self._sync()
            for _ in range(REPS):
                if self.rank == self.injected.late_rank:
                    time.sleep(LATE_FAULT_S)
                entries.append(self.now())
                start = time.perf_counter()
                _call(op, tensor, group)
                self._sync()
                durations.append(time.perf_counter() - start)
        entered = torch.tensor(entries, dtype=torch.float64)
        first = comm.all_reduce(entered.clone(), control, "min")
        last = comm.all_reduce(entered.clone(), control, "max")
        own = torch.where(
            entered == last, torch.tensor(durations, dtype=torch.float64), torch.zeros_like(entered)
        )
        transfer = comm.all_reduce(own, control, "max")
        timings = []
        for i, (op, nbytes) in enumerate(cases):
            reps = slice(i * REPS, (i + 1) * REPS)
            timings.append(
                Timing(
                    kind,
                    group.ranks,
                    op,
                    nbytes,
                    statistics.median(transfer[reps].tolist()),
                    statistics.median((entered[reps] - first[reps]).tolist()),
                )
            )
        return timings


def measure_kinds(topology: Topology, timer: Timer) -> list[Timing]:
    cases = [(op, size) for op in OPS for size in SIZES]
    timings = []
    for label, _ in group_kinds(topology):
        kind = label.split("=")[0]
        comm.barrier(topology.control(WORLD))
        timings += timer.time_group(label, topology.device(kind), topology.control(kind), cases)
    return timings


def measure_links(topology: Topology, timer: Timer) -> list[Timing]:
    """Ring pairs, then pipeline-neighbour pairs. A rank creates only its own pairs' groups (at most two of each
    kind), through the process's groups, walking the pairs in the same order on every rank."""
    timings = []
    cases = [("all_reduce", size) for size in PAIR_SIZES]
    for kind, rounds in (
        ("pair", ring_pairs(topology.shape.world_size)),
        ("pp", pipeline_pairs(topology)),
    ):
        for pairs in rounds:
            mine = [pair for pair in pairs if topology.rank in pair]
            handles = [topology.process_groups.get(pair) for pair in mine]
            comm.barrier(topology.control(WORLD))
            for pair, handle in zip(mine, handles):
                index = pair.index(topology.rank)
                device = comm.Group(kind, pair, index, comm.DEVICE, handle, topology.device_type)
                control = comm.Group(kind, pair, index, comm.CONTROL, handle, topology.device_type)
                timings += timer.time_group(kind, device, control, cases)
    return timings
