"""The attention-overflow signal: the largest pre-softmax attention logit of each block, on monitor steps.

Attention logits q·kᵀ/√d that grow without bound are the classic precursor of a loss spike and, in fp16, of an
overflow (max 65504) — Dehghani et al. 2023 ("Scaling ViT to 22B") and the OPT/BLOOM logbooks trace spikes to
them; QK-norm (`model.qk_norm`) is the fix. The monitor measures them on its sampled step only: `arm` sets a
probe on each local block's attention, whose `_attend` then records the maximum over the pairs it attends
(keel/model/layers.py `record_max_logit`, blockwise), and the monitor reduces the per-block maxima in its existing
max all-reduce. `AttentionLogitWarning` turns the recorded values into one warning per block.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from keel.config import StabilityConfig
from keel.run_dir import AnomalyLog

log = logging.getLogger("keel")
PREFIX, SUFFIX = "attn/", "/max_logit"


class AttentionLogitProbes:
    """The probes of the blocks this rank holds: `arm` before a monitor step's forward passes, `read` after."""

    def __init__(
        self, blocks: list[tuple[int, Any]], n_layers_total: int, device: torch.device
    ) -> None:
        self.attentions = [(index, block.attention) for index, block in blocks]
        self.n_layers_total = n_layers_total
        self.device = device

    def arm(self) -> None:
        for _, attention in self.attentions:
            attention.logit_probe = torch.full((), float("-inf"), device=self.device)

    def read(self) -> torch.Tensor:
        """Per position of the full layer list, this rank's maximum (-inf where it holds no attention); disarms."""
        values = torch.full(
            (self.n_layers_total,), float("-inf"), dtype=torch.float64, device=self.device
        )
        for index, attention in self.attentions:
            if attention.logit_probe is not None:
                values[index] = attention.logit_probe.double()
                attention.logit_probe = None
        return values

    def disarm(self) -> None:
        for _, attention in self.attentions:
            attention.logit_probe = None


class AttentionLogitWarning:
    """Warns once per block when its recorded maximum logit passes `stability.attn_logit_warn` (default 1e4: a
    sixth of fp16's range, where a further doubling or two of ‖q‖·‖k‖ overflows), or grows past
    `stability.attn_logit_growth` × its first recorded value (off by default: at init attention is near uniform,
    so early growth by a large factor is normal training). The values are the same on every rank (reduced by the
    monitor), so every rank decides alike; rank 0 writes the anomaly."""

    def __init__(self, stability: StabilityConfig, anomalies: AnomalyLog) -> None:
        self.warn_at = stability.attn_logit_warn
        self.growth = stability.attn_logit_growth
        self.anomalies = anomalies
        self.first: dict[str, float] = {}
        self.warned: set[str] = set()

    def check(self, step: int, record: dict[str, Any]) -> list[str]:
        """The blocks that warned at this step (each at most once per run)."""
        fired = []
        for key, value in record.items():
            if not (key.startswith(PREFIX) and key.endswith(SUFFIX)):
                continue
            block = key[len(PREFIX) : -len(SUFFIX)]
            first = self.first.setdefault(block, value)
            reason = ""
            if self.warn_at > 0 and value > self.warn_at:
                reason = f"above stability.attn_logit_warn={self.warn_at:g}"
            elif self.growth > 0 and first > 0 and value > self.growth * first:
                reason = (
                    f"{value / first:.1f}x its first recorded {first:.4g} (stability.attn_logit_growth="
                    f"{self.growth:g})"
                )
            if reason and block not in self.warned:
                self.warned.add(block)
                fired.append(block)
                self.anomalies.record(
                    "attention_logits", step, layer=block, max_logit=value, reason=reason
                )
                if self.anomalies.rank == 0:
                    log.warning(
                        "step %d: %s's largest attention logit is %.4g, %s — attention is heading for "
                        "overflow (fp16 max 65504); model.qk_norm bounds it",
                        step,
                        block,
                        value,
                        reason,
                    )
        return fired
