"""Non-finite losses and gradients, and fp16 loss-scale trouble."""

from __future__ import annotations

import math
from collections import deque

from keel.config import StabilityConfig
from keel.run_dir import ExitCode
from keel.training.guards.base import Action, Decision, StepStats


class NonfiniteGuard:
    """A non-finite loss or gradient norm skips the step; too many in a row stop the run with the diagnosis."""

    name = "nonfinite"

    def __init__(self, cfg: StabilityConfig):
        self.cfg = cfg
        self.consecutive = 0

    def check(self, stats: StepStats) -> tuple[Decision, dict | None]:
        bad = [
            name
            for name, v in (("loss", stats.loss), ("grad_norm", stats.grad_norm))
            if v is not None and not math.isfinite(v)
        ]
        if not bad:
            self.consecutive = 0
            return Decision(), None
        self.consecutive += 1
        event = {
            "non_finite": bad,
            "samples": list(stats.sample_range),
            "consecutive": self.consecutive,
        }
        if self.consecutive >= self.cfg.max_nonfinite:
            stop = Decision(
                Action.STOP,
                f"{self.consecutive} consecutive non-finite steps",
                exit_code=ExitCode.FAILED,
            )
            return stop, event
        return Decision(Action.SKIP, f"non-finite {', '.join(bad)}"), event


class LossScaleGuard:
    """fp16: warn when the dynamic loss scale hits its floor or keeps halving — bf16 has no such failure."""

    name = "loss_scale"

    def __init__(self, cfg: StabilityConfig, min_scale: float):
        self.cfg = cfg
        self.min_scale = min_scale
        self.previous: float | None = None
        self.halvings: deque[int] = deque()
        self.warned_floor = False

    def observe(self, step: int, scale: float | None) -> dict | None:
        """Event fields when the scale needs a warning this step, else None."""
        if scale is None:
            return None
        event = None
        if self.previous is not None and scale < self.previous:
            self.halvings.append(step)
        while self.halvings and step - self.halvings[0] >= self.cfg.loss_scale_window:
            self.halvings.popleft()
        self.previous = scale
        advice = "consider bf16, which needs no loss scaling"
        if scale <= self.min_scale and not self.warned_floor:
            self.warned_floor = True
            event = {
                "scale": scale,
                "reason": f"loss scale reached min_loss_scale={self.min_scale}; {advice}",
            }
        elif len(self.halvings) >= self.cfg.loss_scale_halvings:
            event = {
                "scale": scale,
                "reason": f"loss scale halved {len(self.halvings)} times in "
                f"{self.cfg.loss_scale_window} steps; {advice}",
            }
            self.halvings.clear()
        return event
