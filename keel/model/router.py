"""The MoE router: which experts each token visits, with what weight, which rows fit, and the balancing losses.

Scores are computed in fp32 from a [experts, dim] projection. Softmax scoring (Switch, GShard, Mixtral) or
sigmoid scoring (DeepSeek-V3) picks the top-k experts; with k > 1 the chosen weights are renormalised to sum to 1.
The aux-loss-free balancing bias (DeepSeek-V3) shifts only the *choice*, never the weights, so it steers load
without adding gradient.

Capacity (GShard): with `capacity_factor` c > 0, each expert takes at most ceil(c · tokens · k / experts) rows
from this rank's tokens; rows past it are dropped (the token keeps its residual only). Which rows win is the
drop policy: "probability" keeps the highest-weight rows (batch-prioritised routing), "position" keeps every
first choice before any second choice, then earlier tokens first. c = 0 is dropless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from keel.config import ModelConfig
from keel.parallel import comm
from keel.parallel.layer_parallel import NO_PARALLEL, LayerParallel
from keel.parallel.tensor import sum_grad_over_tp


def is_moe_block(cfg: ModelConfig, layer_id: int) -> bool:
    return cfg.moe_experts > 0 and (layer_id + 1) % cfg.moe_every == 0


@dataclass
class Routing:
    """One forward's routing of T tokens to k experts each."""

    experts: torch.Tensor  # [T, k] expert ids
    weights: torch.Tensor  # [T, k] combine weights (fp32, differentiable)
    keep: torch.Tensor  # [T, k] bool: the row fits its expert's capacity
    aux_loss: torch.Tensor  # weighted balancing + z loss (fp32 scalar, differentiable)
    probs: torch.Tensor  # [T, E] routing distribution (detached), for the entropy statistic


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: LayerParallel = NO_PARALLEL) -> None:
        super().__init__()
        self.tp = parallel.tp
        self.seq = parallel.seq  # the ranks splitting a sequence (cp × sp)
        self.num_experts = cfg.moe_experts
        self.top_k = cfg.moe_top_k
        self.scoring = cfg.moe_scoring
        self.jitter = cfg.moe_jitter
        self.capacity_factor = cfg.moe_capacity_factor
        self.drop_policy = cfg.moe_drop_policy
        self.aux_weight = cfg.moe_aux_loss
        self.z_weight = cfg.moe_z_loss
        # Replicated over tp; every tp rank computes the same routing from the same (gathered) tokens.
        self.weight = nn.Parameter(torch.empty(cfg.moe_experts, cfg.dim))
        # Aux-loss-free balancing bias: a persistent buffer (checkpointed), moved by ExpertHealth after each step.
        self.register_buffer("balance_bias", torch.zeros(cfg.moe_experts))
        # fault injection: added to the choice scores only
        self.choice_offset: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> Routing:
        # Switch's multiplicative jitter, same draw on every tp rank
        if self.training and self.jitter > 0:
            tokens = tokens * torch.empty_like(tokens).uniform_(
                1.0 - self.jitter, 1.0 + self.jitter
            )
        logits = F.linear(tokens.float(), sum_grad_over_tp(self.weight, self.tp).float())
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.balance_bias
        if self.choice_offset is not None:
            choice = choice + self.choice_offset.to(choice.device)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        probs = scores if self.scoring == "softmax" else scores / scores.sum(-1, keepdim=True)
        return Routing(
            experts,
            weights,
            self._capacity_keep(experts, weights.detach()),
            self._aux_loss(logits, probs, experts),
            probs.detach(),
        )

    def _aux_loss(
        self, logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """α · E · Σ_e f_e · P_e (f_e: share of the T·k rows routed to e, P_e: mean probability of e; 1.0 when
        uniform) plus β · mean(logsumexp(logits)²), the router z-loss.

        Under Ulysses sp or context parallel cp the T tokens of a sequence are spread over the cp × sp ranks: the
        counts f_e and T are summed over the group (no gradient), and each rank returns its tokens' share of the
        sums, so the ranks' losses add up to the full sequence's and their gradients (which DeepSpeed sums over
        them) to its gradient.
        """
        loss = logits.new_zeros(())
        if self.aux_weight == 0 and self.z_weight == 0:
            return loss
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts).float()
        stats = torch.cat([counts, counts.new_tensor([experts.shape[0]])])
        if self.seq.size > 1:
            comm.all_reduce(stats, self.seq.group)
        counts, tokens = stats[:-1], stats[-1]
        if self.aux_weight > 0:
            share = counts / (tokens * self.top_k)
            loss = loss + self.aux_weight * self.num_experts * (share * probs.sum(0)).sum() / tokens
        if self.z_weight > 0:
            loss = loss + self.z_weight * torch.logsumexp(logits, -1).pow(2).sum() / tokens
        return loss

    def _capacity_keep(self, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.capacity_factor <= 0:
            return torch.ones_like(experts, dtype=torch.bool)
        tokens, k = experts.shape
        capacity = math.ceil(self.capacity_factor * tokens * k / self.num_experts)
        # every first choice, then every second choice, each in token order
        if self.drop_policy == "position":
            priority = torch.argsort(experts.t().flatten(), stable=True)
            row_ids = (
                torch.arange(tokens * k, device=experts.device)
                .view(tokens, k)
                .t()
                .flatten()[priority]
            )
        else:  # highest weight first (ties: token order)
            by_weight = torch.argsort(weights.flatten(), descending=True, stable=True)
            row_ids = by_weight[torch.argsort(experts.flatten()[by_weight], stable=True)]
        sorted_experts = experts.flatten()[row_ids]
        starts = torch.searchsorted(sorted_experts, sorted_experts, right=False)
        fits = (torch.arange(tokens * k, device=experts.device) - starts) < capacity
        keep = torch.zeros(tokens * k, dtype=torch.bool, device=experts.device)
        keep[row_ids] = fits
        return keep.view(tokens, k)
