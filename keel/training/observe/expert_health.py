"""Expert health for MoE runs: load per expert, dropped rows and router entropy; the expert-collapse warning; the
aux-loss-free balancing bias; and the aux loss's gradient scale.

Routing counts accumulate on device during the forwards (keel/model/moe.py). Every `stability.expert_interval`
steps one all-reduce over the world gathers every MoE layer's counts: each layer's counts sit in that layer's
slot of a vector every rank lays out the same way, the data-parallel replicas' counts add up, pipeline stages
fill disjoint slots, and only tp rank 0 contributes (tp ranks route the same tokens identically).

An expert whose share of the rows stays under `expert_collapse_share` × 1/E for `expert_collapse_checks`
consecutive checks is collapsing: the router has learned to starve it (its parameters then stop learning).
"""

from __future__ import annotations

import logging
import math

import torch

from keel.config import RunConfig
from keel.engine.ds_config import engine_batch_copies
from keel.model.moe import moe_layers
from keel.model.router import is_moe_block
from keel.parallel import comm
from keel.parallel.topology import Topology
from keel.run_dir import AnomalyLog

log = logging.getLogger("keel")


class ExpertHealth:
    def __init__(
        self, cfg: RunConfig, model: torch.nn.Module, topology: Topology, anomalies: AnomalyLog
    ):
        stability = cfg.stability
        self.num_experts = cfg.model.moe_experts
        self.layers = moe_layers(model)
        # every MoE block, on any stage
        self.block_ids = [i for i in range(cfg.model.n_layers) if is_moe_block(cfg.model, i)]
        self.slot = {block: n for n, block in enumerate(self.block_ids)}
        self.interval = stability.expert_interval
        self.collapse_share, self.collapse_checks = (
            stability.expert_collapse_share,
            stability.expert_collapse_checks,
        )
        self.bias_update = cfg.model.moe_bias_update
        self.top_k = cfg.model.moe_top_k
        # the pipeline engine averages gradients over its data axis, which holds the Ulysses sp ranks: their aux
        # losses (shares of the sequence's, summed over sp elsewhere) get sp times the main loss's scale
        self.engine_copies = engine_batch_copies(cfg)
        self.contributes = topology.rank_in("tp") == 0
        # the counts live where the model runs: the device channel. Each step's bias update needs only this
        # stage's layers (the stage group); the periodic health record reports every stage's (the world).
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
        self.stage_group, self.world_group = topology.device("stage"), topology.device("world")
        self.anomalies = anomalies
        self.streaks = [[0] * self.num_experts for _ in self.block_ids]
        if cfg.faults.starve_expert >= 0:
            offset = torch.zeros(self.num_experts)
            offset[cfg.faults.starve_expert] = -1e4  # below any score: never among the top k
            for layer in self.layers:
                layer.router.choice_offset = offset
            log.warning(
                "fault injection: the routers never choose expert %d", cfg.faults.starve_expert
            )

    @property
    def active(self) -> bool:
        return self.num_experts > 0

    def before_step(self, loss_scale: float, accumulation_steps: int) -> None:
        """The aux losses' gradient is the main loss's: DeepSpeed scales the loss by loss_scale / accumulation (and
        the pipeline engine's average over sp, undone as keel/parallel/ulysses.py's sequence mean undoes it)."""
        for layer in self.layers:
            layer.aux_grad_scale = loss_scale / accumulation_steps * self.engine_copies

    def _all_layers(self, rows: int, fill, group: comm.Group) -> torch.Tensor:
        """Sum over `group` of a [MoE blocks, rows] table each rank fills for its own layers (tp rank 0 only)."""
        table = torch.zeros(len(self.block_ids), rows, dtype=torch.float64, device=self.device)
        if self.contributes:
            for layer in self.layers:
                table[self.slot[layer.layer_id]] = fill(layer).to(table.device)
        return comm.all_reduce(table, group)

    def after_step(self, step: int, applied: bool) -> dict:
        """Bias balancing after an applied step; every `interval` steps the health record for this step."""
        if not self.active:
            return {}
        if self.bias_update > 0:
            counts = self._all_layers(
                self.num_experts, lambda layer: layer.stats.step_routed, self.stage_group
            )
            if applied:
                self._nudge_biases(counts)
        for layer in self.layers:
            layer.stats.step_routed.zero_()
        if not self.interval or step % self.interval:
            return {}
        table = self._all_layers(
            self.num_experts + 3, lambda layer: layer.stats.vector(), self.world_group
        )
        for layer in self.layers:
            layer.stats.reset()
        return {
            "moe": {
                f"L{block}": self._report(step, n, block, row.tolist())
                for n, (block, row) in enumerate(zip(self.block_ids, table))
            }
        }

    @torch.no_grad()
    def _nudge_biases(self, counts: torch.Tensor) -> None:
        """DeepSeek-V3's aux-loss-free balancing: raise under-loaded experts' bias, lower over-loaded ones'."""
        for layer in self.layers:
            load = counts[self.slot[layer.layer_id]]
            step = self.bias_update * torch.sign(load.mean() - load)
            layer.router.balance_bias.add_(step.to(layer.router.balance_bias))

    def _report(self, step: int, slot: int, block: int, row: list[float]) -> dict:
        routed, (dropped, entropy, tokens) = row[: self.num_experts], row[self.num_experts :]
        total = sum(routed) or 1.0
        shares = [r / total for r in routed]
        load_entropy = -sum(p * math.log(p) for p in shares if p > 0) / math.log(self.num_experts)
        for expert, share in enumerate(shares):
            starving = share < self.collapse_share / self.num_experts
            self.streaks[slot][expert] = self.streaks[slot][expert] + 1 if starving else 0
            if self.streaks[slot][expert] == self.collapse_checks:
                self.anomalies.record(
                    "expert_collapse",
                    step,
                    layer=block,
                    expert=expert,
                    share=share,
                    checks=self.collapse_checks,
                )
                if self.anomalies.rank == 0:
                    log.warning(
                        "step %d: expert collapse in block %d: expert %d got %.4f of the rows for %d checks "
                        "(uniform %.4f); raise model.moe_aux_loss or enable model.moe_bias_update",
                        step,
                        block,
                        expert,
                        share,
                        self.collapse_checks,
                        1 / self.num_experts,
                    )
        return {
            "tokens_per_expert": [round(r) for r in routed],
            "load_entropy": load_entropy,
            "min_share": min(shares) * self.num_experts,
            "max_share": max(shares) * self.num_experts,
            "dropped": dropped / max(tokens * self.top_k, 1.0),
            "router_entropy": entropy / max(tokens, 1.0),
        }
