"""Cross-rank checks: data-parallel replicas should see similar losses and must hold identical parameters.

A rank fed corrupt data shows up as a loss outlier among its data-parallel peers; a flaky GPU or a bit flip
shows up as a replica whose parameters differ. Both checks are collectives run every N steps on all ranks.
`checksum` is also what guards/at_rest.py seals a rank's own ZeRO partition with (state that has no replica).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable

import torch

from keel.parallel import comm
from keel.parallel.topology import Topology
from keel.run_dir import node_name

# A replica's loss travels as its float32 bits made order-preserving, keyed with the world rank holding it, so one
# MAX all-reduce names the highest and the lowest replica
_RANK_BITS = 20  # up to 1,048,576 ranks
_FLOAT32_MAX = 3.4028234663852886e38


def _ordered(value: float) -> int:
    """float32 `value`'s bits as an integer in [1, 2**32) that orders as the floats do."""
    bits = struct.unpack("<I", struct.pack("<f", max(-_FLOAT32_MAX, min(value, _FLOAT32_MAX))))[0]
    return (~bits & 0xFFFFFFFF) if bits >> 31 else bits | 0x80000000


def _float_of(key: int) -> float:
    bits = (key & 0x7FFFFFFF) if key >> 31 else (~key & 0xFFFFFFFF)
    return struct.unpack("<f", struct.pack("<I", bits))[0]


class LossOutlierCheck:
    """Flags a data-parallel replica whose local loss is more than k σ from the others, R checks running.

    In O(1) bytes per rank: one rank per replica (its loss holder of tp and seq rank 0) adds its loss to a sum, a sum
    of squares and a count, and one MAX all-reduce names the highest and the lowest replica, the only ones that can
    stand out from the rest; each is judged against the others' mean and spread (the sums without it). The host
    of a flagged replica comes from that rank alone. On cbd7c25 every rank gathered every rank's loss and host."""

    name = "loss_outlier"

    def __init__(self, topology: Topology, sigmas: float, repeats: int):
        self.topology = topology
        self.sigmas = sigmas
        self.repeats = repeats
        self.streak: dict[
            int, int
        ] = {}  # consecutive flags of a replica still flagged (at most two)

    def check(self, local_loss: float | None) -> list[dict]:
        """Collective over the world; `local_loss` is this replica's loss where this rank holds it, else None.

        Returns one event per flagged replica (identical on every rank)."""
        topology = self.topology
        world = topology.control("world")
        holds = (
            local_loss is not None
            and math.isfinite(local_loss)
            and topology.rank_in("tp") == 0
            and topology.rank_in("seq") == 0
        )
        x = float(local_loss) if holds else 0.0
        sums = comm.all_reduce(
            torch.tensor([float(holds), x, x * x], dtype=torch.float64), world
        ).tolist()
        low = 2**_RANK_BITS - 1
        tag = low - world.rank
        keys = torch.tensor(
            [_ordered(x) << _RANK_BITS | tag, _ordered(-x) << _RANK_BITS | tag]
            if holds
            else [0, 0],
            dtype=torch.int64,
        )
        highest, lowest = comm.all_reduce(keys, world, "max").tolist()
        count, total, squares = sums
        n = round(count)
        if n < 3:  # with two replicas there is no majority to be an outlier from
            self.streak = {}
            return []
        candidates = {}
        for key, sign in ((highest, 1.0), (lowest, -1.0)):
            rank = world.ranks[low - (key & low)]
            candidates[rank] = sign * _float_of(key >> _RANK_BITS)
        streak, flagged = {}, []
        for rank, loss in sorted(candidates.items()):
            mean = (total - loss) / (n - 1)
            spread = max(0.0, squares - loss * loss - (n - 1) * mean * mean) / max(1, n - 2)
            sigma = max(math.sqrt(spread), 1e-3 * abs(mean), 1e-8)
            deviation = abs(loss - mean) / sigma
            dp_rank = _dp_index(topology, rank)
            if deviation > self.sigmas:
                streak[dp_rank] = self.streak.get(dp_rank, 0) + 1
                if streak[dp_rank] >= self.repeats:
                    flagged.append((dp_rank, rank, loss, mean, deviation))
        self.streak = streak
        events = []
        hosts = hosts_of((rank for _, rank, *_ in flagged), topology)
        for dp_rank, rank, loss, mean, deviation in flagged:
            host = hosts[rank]
            events.append(
                {
                    "dp_rank": dp_rank,
                    "flagged_rank": rank,
                    "host": host,
                    "loss": loss,
                    "others_mean": mean,
                    "sigmas": deviation,
                    "consecutive": streak[dp_rank],
                }
            )
        return events


def hosts_of(ranks: Iterable[int], topology: Topology) -> dict[int, str]:
    """Each named rank's node, from that rank alone (one broadcast per rank, in rank order): collective over the
    world, for the rare event that names ranks (every rank must pass the same ranks)."""
    world = topology.control("world")
    return {
        rank: comm.broadcast_object(node_name(), world, src=world.ranks.index(rank))
        for rank in sorted(set(ranks))
    }


def _dp_index(topology: Topology, rank: int) -> int:
    """`rank`'s index in its data-parallel group (edp × ep)."""
    coords = topology.shape.coords(rank)
    return coords["edp"] * topology.shape.ep + coords["ep"]


# words per chunk: 2 MiB of int64 temporaries + 2 MiB of weights, whatever the tensor size
CHUNK_WORDS = 1 << 18


def _words(chunk: torch.Tensor) -> torch.Tensor:
    """The chunk's raw bits as signed integer words (int32 for 4- and 8-byte types, int16 for 2-byte, uint8)."""
    size = chunk.element_size()
    return chunk.view(torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8)


class Checksummer:
    """Position-weighted sums of raw bits, computed in fixed-size chunks on the tensors' device.

    checksum = Σ_k (2k+1) · Σ_j (2j+1) · word[k·C + j]   (mod 2^64, two's-complement wrap of torch's int64 ops)

    Flipping bit b of one word changes the word by ±2^b (b < 32), so the checksum by ±(2k+1)(2j+1)·2^b mod 2^64:
    an odd number times 2^b with b < 64, never 0 — so any single flipped bit changes the checksum, whatever the
    wrap-around; the position weights also catch swapped words. Temporaries: one int64 scratch chunk and the
    weights (`CHUNK_WORDS` each, allocated once), not a copy of the tensor. Results stay on the device: `sums`
    fills one int64 tensor for a list of tensors, so a whole check costs one host sync where its caller reads it.
    """

    def __init__(self, chunk_words: int = CHUNK_WORDS):
        self.chunk_words = chunk_words
        self._buffers: dict[
            torch.device, tuple[torch.Tensor, torch.Tensor]
        ] = {}  # per device, built once

    def buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the odd position weights 1, 3, 5, …, an int64 scratch chunk), reused by every checksum."""
        if device not in self._buffers:
            weights = torch.arange(self.chunk_words, dtype=torch.int64, device=device) * 2 + 1
            self._buffers[device] = (weights, torch.empty_like(weights))
        return self._buffers[device]

    @torch.no_grad()
    def checksum(self, tensor: torch.Tensor) -> torch.Tensor:
        """0-d int64 on `tensor`'s device (no host sync)."""
        # a view for contiguous tensors (parameters, partitions, states)
        flat = tensor.detach().reshape(-1)
        total = torch.zeros((), dtype=torch.int64, device=flat.device)
        if flat.numel() == 0:
            return total
        words_per_element = max(1, flat.element_size() // 4)
        step = max(1, self.chunk_words // words_per_element)
        weights, scratch = self.buffers(flat.device)
        for k, start in enumerate(range(0, flat.numel(), step)):
            words = _words(flat[start : start + step].contiguous())
            n = words.numel()
            # widened to int64 as it multiplies: no allocation
            torch.mul(words, weights[:n], out=scratch[:n])
            total += scratch[:n].sum() * (2 * k + 1)
        return total

    def sums(self, tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
        """One int64 checksum per tensor, in one tensor on `device`."""
        values = [self.checksum(t).to(device) for t in tensors]
        return torch.stack(values) if values else torch.zeros(0, dtype=torch.int64, device=device)


def checksum(tensor: torch.Tensor) -> int:
    """`Checksummer().checksum(tensor)` as a Python int (one host sync: for tests and one-off use)."""
    return int(Checksummer().checksum(tensor))


class ChecksumCheck:
    """Compares checksums of replicated parameters across their replicas (unless ZeRO-3 partitions them): dense
    parameters over data × Ulysses-sequence parallel ranks, expert parameters over their expert-data-parallel
    replicas (ep ranks hold different experts), TP-replicated parameters over the TP group. Names each
    mismatching parameter and rank. One device all_gather per group, one host sync for the whole check."""

    name = "checksum_mismatch"

    def __init__(
        self, model: torch.nn.Module, topology: Topology, zero_stage: int, checksummer: Checksummer
    ):
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.topology = topology
        self.check_dp = zero_stage < 3
        self.checksummer = checksummer
        self.device = next(model.parameters()).device

    def comparisons(self) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
        """(group, parameters) pairs this check compares; the same on every rank of a group."""
        out = []
        dense = [(n, p) for n, p in self.params if getattr(p, "allreduce", True)]
        experts = [
            (n, p) for n, p in self.params if not getattr(p, "allreduce", True)
        ]  # DeepSpeed's MoE mark
        for group, params in (("sp_dp", dense), ("expert_dp", experts)):
            if self.check_dp and params and self.topology.size(group) > 1:
                out.append((group, params))
        if self.topology.size("tp") > 1:
            out.append(
                (
                    "tp",
                    [
                        (n, p)
                        for n, p in self.params
                        if not getattr(p, "tensor_model_parallel", False)
                    ],
                )
            )
        return out

    def gather(self) -> list[tuple[str, list[str], torch.Tensor]]:
        """Start the check: (group, parameter names, [ranks, params] device table) per comparison, not yet read."""
        gathered = []
        for group, params in self.comparisons():
            sums = self.checksummer.sums((p for _, p in params), self.device)
            table = torch.stack(comm.all_gather(sums, self.topology.device(group)))
            gathered.append((group, [n for n, _ in params], table))
        return gathered

    def events(self, group: str, names: list[str], table: list[list[int]]) -> list[dict]:
        """Mismatch events from one comparison's table, read back on the host (identical on every rank)."""
        ranks = self.topology.ranks(group)
        events = []
        for column, name in enumerate(names):
            values = [row[column] for row in table]
            if len(set(values)) == 1:
                continue
            majority = max(sorted(set(values)), key=values.count)
            if 2 * values.count(majority) > len(values):
                events.append(
                    {
                        "parameter": name,
                        "group": group,
                        "ranks": [ranks[i] for i, v in enumerate(values) if v != majority],
                        "group_ranks": ranks,
                    }
                )
            else:  # no majority (e.g. two replicas): which one is wrong is not knowable from here
                events.append(
                    {
                        "parameter": name,
                        "group": group,
                        "ranks": ranks,
                        "group_ranks": ranks,
                        "ambiguous": True,
                    }
                )
        return events

    def check(
        self, changed: tuple[list[tuple[str, str]], torch.Tensor] | None = None
    ) -> list[dict]:
        """Collective on every rank. `changed`: this rank's at-rest verification (guards/at_rest.py, entries and
        device flags), whose count is summed over the world in the same host sync; only when some rank found a
        change do the ranks exchange names (a second, rare collective)."""
        gathered = self.gather()
        flags = (
            changed[1]
            if changed is not None
            else torch.zeros(0, dtype=torch.bool, device=self.device)
        )
        count = comm.all_reduce(flags.sum().to(torch.int64).view(1), self.topology.device("world"))
        # the one device → host sync
        host = torch.cat([t.flatten() for _, _, t in gathered] + [count]).tolist()
        events, offset = [], 0
        for group, names, table in gathered:
            rows, cols = table.shape
            flat = host[offset : offset + rows * cols]
            offset += rows * cols
            events += self.events(
                group, names, [flat[r * cols : (r + 1) * cols] for r in range(rows)]
            )
        if host[-1] > 0:
            events += self._at_rest_events(changed)
        return events

    def _at_rest_events(
        self, changed: tuple[list[tuple[str, str]], torch.Tensor] | None
    ) -> list[dict]:
        """One event per (rank, parameter) whose own state changed at rest, naming the state (identical on every
        rank)."""
        mine: dict[str, list[str]] = {}
        if changed is not None:
            for (name, state), bad in zip(changed[0], changed[1].tolist()):
                if bad:
                    mine.setdefault(name, []).append(state)
        everyone = comm.all_gather_object(
            (self.topology.rank, mine), self.topology.control("world")
        )
        return [
            {"parameter": name, "group": "at_rest", "ranks": [rank], "states": states}
            for rank, found in everyone
            for name, states in found.items()
        ]
