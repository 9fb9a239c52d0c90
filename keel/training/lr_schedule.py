"""Learning-rate schedules as multipliers of the peak LR, driven by the optimizer step.

Written by hand because the schedule must be a pure function of the step (so resume at any step, and at any
world size, reproduces it exactly) and DeepSpeed's built-in schedulers do not cover the shapes we need.
"""

from __future__ import annotations

import math

import torch

from keel.config import TrainConfig

SCHEDULES = ("cosine", "linear", "constant")


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Multiplier for the LR used by optimizer step `step` (0-based): linear warmup, then decay to min ratio."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif cfg.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        raise ValueError(f"train.lr_schedule={cfg.lr_schedule!r}: choose one of {', '.join(SCHEDULES)}")
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose state (last_epoch) DeepSpeed saves and restores with its checkpoints."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
