"""Loss and gradient-norm spike detection, with skip and — when spikes cluster — rollback.

Statistics are kept over healthy steps only (a spike never enters the history it is judged against), and
every input is a globally reduced value, so all ranks keep identical state and reach the same decision.
"""

from __future__ import annotations

import math
from collections import deque

from keel.config import StabilityConfig
from keel.training.guards.base import Action, Decision, StepStats


class RunningStat:
    """Window mode: mean + k·σ over the last `window` values. EMA mode: value > factor × EMA."""

    def __init__(self, cfg: StabilityConfig):
        self.cfg = cfg
        self.values: deque[float] = deque(maxlen=cfg.spike_window)
        self.ema: float | None = None
        self.count = 0

    def threshold(self) -> float | None:
        if self.count < self.cfg.spike_warmup:
            return None
        if self.cfg.spike_mode == "ema":
            return self.cfg.spike_ema_factor * self.ema
        mean = sum(self.values) / len(self.values)
        var = sum((v - mean) ** 2 for v in self.values) / max(1, len(self.values) - 1)
        return mean + self.cfg.spike_sigmas * math.sqrt(var)

    def add(self, value: float) -> None:
        self.values.append(value)
        beta = self.cfg.spike_ema_beta
        self.ema = value if self.ema is None else beta * self.ema + (1 - beta) * value
        self.count += 1

    def state_dict(self) -> dict:
        return {"values": list(self.values), "ema": self.ema, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.values = deque(state["values"], maxlen=self.cfg.spike_window)
        self.ema, self.count = state["ema"], state["count"]


class SpikeGuard:
    name = "spike"

    def __init__(self, cfg: StabilityConfig):
        self.cfg = cfg
        self.loss = RunningStat(cfg)
        self.grad_norm = RunningStat(cfg)
        self.recent_spikes: list[int] = []  # steps of spikes not yet answered by a rollback

    def check(self, stats: StepStats) -> tuple[Decision, dict | None]:
        """The decision for this step and, on a spike, the event fields to record."""
        if not self.cfg.spike or not math.isfinite(stats.loss):
            return Decision(), None  # non-finite values are the non-finite guard's
        over = {}
        for name, stat, value in (
            ("loss", self.loss, stats.loss),
            ("grad_norm", self.grad_norm, stats.grad_norm),
        ):
            if value is None or not math.isfinite(value):
                continue
            limit = stat.threshold()
            if limit is not None and value > limit:
                over[name] = {"value": value, "threshold": limit}
        if not over:
            self.loss.add(stats.loss)
            if stats.grad_norm is not None and math.isfinite(stats.grad_norm):
                self.grad_norm.add(stats.grad_norm)
            return Decision(), None
        self.recent_spikes = [
            s for s in self.recent_spikes if stats.step - s < self.cfg.rollback_window
        ]
        self.recent_spikes.append(stats.step)
        event = {
            "values": over,
            "samples": list(stats.sample_range),
            "spikes_in_window": len(self.recent_spikes),
        }
        if len(self.recent_spikes) >= self.cfg.rollback_spikes:
            event["first_spike_step"] = self.recent_spikes[0]
            self.recent_spikes = []
            return Decision(
                Action.ROLLBACK,
                f"{self.cfg.rollback_spikes} spikes within {self.cfg.rollback_window} steps",
            ), event
        return Decision(Action.SKIP, f"spike in {', '.join(over)}"), event

    def state_dict(self) -> dict:
        return {
            "loss": self.loss.state_dict(),
            "grad_norm": self.grad_norm.state_dict(),
            "recent_spikes": list(self.recent_spikes),
        }

    def load_state_dict(self, state: dict) -> None:
        self.loss.load_state_dict(state["loss"])
        self.grad_norm.load_state_dict(state["grad_norm"])
        self.recent_spikes = list(state["recent_spikes"])
