"""Cross-rank checks: data-parallel replicas should see similar losses and must hold identical parameters.

A rank fed corrupt data shows up as a loss outlier among its data-parallel peers; a flaky GPU or a bit flip
shows up as a replica whose parameters differ. Both checks are collectives run every N steps on all ranks.
"""

from __future__ import annotations

import math
import socket

import torch

from keel.parallel import comm
from keel.parallel.topology import Topology


class LossOutlierCheck:
    """Flags a data-parallel replica whose local loss is more than k σ from the others, R checks running."""

    name = "loss_outlier"

    def __init__(self, topology: Topology, sigmas: float, repeats: int):
        self.topology = topology
        self.sigmas = sigmas
        self.repeats = repeats
        self.streak: dict[int, int] = {}

    def check(self, local_loss: float | None) -> list[dict]:
        """Collective over the world; `local_loss` is this replica's loss where this rank holds it, else None.

        Returns one event per flagged replica (identical on every rank)."""
        value = math.nan if local_loss is None else float(local_loss)
        gathered = comm.all_gather_object((value, socket.gethostname()), self.topology.control("world"))
        per_replica: dict[int, tuple[float, str, int]] = {}
        for rank, (loss, host) in enumerate(gathered):
            dp_rank = self.topology.shape.coords(rank)["edp"] * self.topology.shape.ep + \
                self.topology.shape.coords(rank)["ep"]
            if not math.isnan(loss) and dp_rank not in per_replica:
                per_replica[dp_rank] = (loss, host, rank)
        events = []
        if len(per_replica) < 3:  # with two replicas there is no majority to be an outlier from
            return events
        for dp_rank, (loss, host, rank) in sorted(per_replica.items()):
            others = [v[0] for k, v in per_replica.items() if k != dp_rank]
            mean = sum(others) / len(others)
            std = math.sqrt(sum((o - mean) ** 2 for o in others) / max(1, len(others) - 1))
            sigma = max(std, 1e-3 * abs(mean), 1e-8)
            deviation = abs(loss - mean) / sigma
            self.streak[dp_rank] = self.streak.get(dp_rank, 0) + 1 if deviation > self.sigmas else 0
            if self.streak[dp_rank] >= self.repeats:
                events.append({"dp_rank": dp_rank, "flagged_rank": rank, "host": host, "loss": loss,
                               "others_mean": mean, "sigmas": deviation, "consecutive": self.streak[dp_rank]})
        return events


def checksum(tensor: torch.Tensor) -> int:
    """Position-weighted sum of the raw bytes: any single flipped bit changes it."""
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(raw.numel(), dtype=torch.int64, device=raw.device) % 65521 + 1
    return int((raw * weights).sum())


class ChecksumCheck:
    """Compares checksums of replicated parameters across their replicas (unless ZeRO-3 partitions them): dense
    parameters over data × Ulysses-sequence parallel ranks, expert parameters over their expert-data-parallel
    replicas (ep ranks hold different experts), TP-replicated parameters over the TP group. Names each
    mismatching parameter and rank."""

    name = "checksum_mismatch"

    def __init__(self, model: torch.nn.Module, topology: Topology, zero_stage: int):
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.topology = topology
        self.check_dp = zero_stage < 3

    def check(self) -> list[dict]:
        events = []
        dense = [(n, p) for n, p in self.params if getattr(p, "allreduce", True)]
        experts = [(n, p) for n, p in self.params if not getattr(p, "allreduce", True)]  # DeepSpeed's MoE mark
        for group, params in (("sp_dp", dense), ("expert_dp", experts)):
            if self.check_dp and params and self.topology.size(group) > 1:
                events += self._compare(group, params)
        if self.topology.size("tp") > 1:
            replicated = [(n, p) for n, p in self.params if not getattr(p, "tensor_model_parallel", False)]
            events += self._compare("tp", replicated)
        return events

    def _compare(self, group_name: str, params: list[tuple[str, torch.Tensor]]) -> list[dict]:
        sums = torch.tensor([checksum(p) for _, p in params], dtype=torch.int64)  # host integers: control
        gathered = comm.all_gather(sums, self.topology.control(group_name))
        ranks = self.topology.ranks(group_name)
        table = torch.stack(gathered)  # [ranks, params]
        events = []
        for column, (name, _) in enumerate(params):
            values = table[:, column].tolist()
            majority = max(set(values), key=values.count)
            odd = [ranks[i] for i, v in enumerate(values) if v != majority]
            if odd:
                events.append({"parameter": name, "group": group_name, "ranks": odd, "group_ranks": ranks})
        return events
