"""Learning-rate schedules as multipliers of the peak LR, driven by the optimizer step, and batch-size ramp-up.

Written by hand because the schedule must be a pure function of the step (so resume at any step, and at any
world size, reproduces it exactly) and DeepSpeed's built-in schedulers do not cover the shapes we need. The
batch-size ramp-up is a pure function of the step too, for the same reason: the data position after a resume is
`samples_before_step(step)`, computed rather than remembered.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from keel.config import LR_SCHEDULES, RAMPUP_SCALINGS, TrainConfig


# -- the LR shape ---------------------------------------------------------------------------------------------
def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Multiplier of `cfg.lr` for optimizer step `step` (0-based).

    Every schedule starts with the same linear warmup, (step+1)/warmup_steps, which reaches 1.0 on the last warmup
    step. After it:

    - cosine / linear: decay from 1.0 to min_lr_ratio, reaching it at step == steps.
    - constant: 1.0.
    - inverse_sqrt (Noam): sqrt(w / (step+1)) with w = max(1, warmup_steps). This equals 1.0 at step+1 == w,
      the last warmup step, so the two pieces meet there; together they are Noam's min(n/w, sqrt(w/n)) with
      n = step+1. Floored at min_lr_ratio: it has no end of its own and would otherwise fall without limit.
    - wsd (warmup-stable-decay): 1.0 until the last decay_fraction·steps steps, which decay to min_lr_ratio by
      1 - sqrt(progress) (reaching it at step == steps). 1-sqrt rather than linear because it ends with a lower
      loss for the same decay length (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed
      Training Durations"). The decay never starts before warmup ends, so a long warmup shortens the decay
      instead of making the schedule jump.
    """
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.lr_schedule == "constant":
        return 1.0
    if cfg.lr_schedule == "inverse_sqrt":
        return max(floor, math.sqrt(max(1, cfg.warmup_steps) / (step + 1)))
    if cfg.lr_schedule == "wsd":
        decay_start = max(cfg.warmup_steps, cfg.steps - round(cfg.decay_fraction * cfg.steps))
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, cfg.steps - decay_start))
        return floor + (1.0 - floor) * (1.0 - math.sqrt(progress))
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif cfg.lr_schedule == "linear":
        shape = 1.0 - progress
    else:
        raise ValueError(f"train.lr_schedule={cfg.lr_schedule!r}: choose one of {', '.join(LR_SCHEDULES)}")
    return floor + (1.0 - floor) * shape


# -- batch-size ramp-up ---------------------------------------------------------------------------------------
def rampup_enabled(cfg: TrainConfig) -> bool:
    return cfg.rampup_start_batch > 0


def rampup_batch_size(step: int, cfg: TrainConfig, dp: int = 1) -> int:
    """Global batch size (samples) of optimizer step `step`.

    Linear from rampup_start_batch at step 0 to global_batch_size at step rampup_steps, rounded down to a multiple
    of micro_batch_size×dp (the smallest batch every data-parallel rank can split evenly) and never below it.
    Integer arithmetic throughout, so the sequence is exact and `samples_before_step` can invert it.
    """
    if not rampup_enabled(cfg) or step >= cfg.rampup_steps:
        return cfg.global_batch_size
    unit = cfg.micro_batch_size * dp
    start, end = cfg.rampup_start_batch, cfg.global_batch_size
    raw = start + (end - start) * max(0, step) // cfg.rampup_steps
    return max(unit, raw // unit * unit)


def _first_step_reaching(batch: int, cfg: TrainConfig) -> int:
    """The first step whose un-rounded ramp value is >= `batch` (inverts `rampup_batch_size`'s floor)."""
    start, end = cfg.rampup_start_batch, cfg.global_batch_size
    return max(0, -(-(batch - start) * cfg.rampup_steps // (end - start)))  # ceil division


def samples_before_step(step: int, cfg: TrainConfig, dp: int = 1) -> int:
    """Global samples consumed by steps [0, step): the data position at which step `step` starts.

    Closed form over the ramp's batch levels (at most global_batch_size / unit of them), so it is cheap at any
    step and needs no state: a resume at step k continues exactly where an uninterrupted run would be.
    """
    if step <= 0:
        return 0
    if not rampup_enabled(cfg):
        return step * cfg.global_batch_size
    unit = cfg.micro_batch_size * dp
    ramp_end = min(step, cfg.rampup_steps)
    total, level, level_start = 0, rampup_batch_size(0, cfg, dp), 0
    while level_start < ramp_end:
        nxt = level + unit
        level_end = min(ramp_end, max(level_start, _first_step_reaching(nxt, cfg)))
        total += level * (level_end - level_start)
        level, level_start = nxt, level_end
    return total + cfg.global_batch_size * max(0, step - cfg.rampup_steps)


def rampup_lr_factor(step: int, cfg: TrainConfig, dp: int = 1) -> float:
    """LR factor that follows the ramped batch: batch/global (linear), its square root (sqrt), or 1 (none).

    A smaller batch has noisier gradients, so the peak LR tuned for the full batch is too high for it; linear is
    the SGD scaling rule, sqrt the usual one for Adam.
    """
    ratio = rampup_batch_size(step, cfg, dp) / cfg.global_batch_size
    if cfg.rampup_lr_scaling == "linear":
        return ratio
    if cfg.rampup_lr_scaling == "sqrt":
        return math.sqrt(ratio)
    if cfg.rampup_lr_scaling == "none":
        return 1.0
    raise ValueError(f"train.rampup_lr_scaling={cfg.rampup_lr_scaling!r}: choose one of {', '.join(RAMPUP_SCALINGS)}")


# -- the scheduler DeepSpeed steps ----------------------------------------------------------------------------
def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, dp: int = 1,
                    extra_scale: Callable[[], float] | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose state (last_epoch) DeepSpeed saves and restores with its checkpoints.

    The multiplier is lr_multiplier × rampup_lr_factor × extra_scale(). `extra_scale` is read each time the
    scheduler steps (inside engine.step(), setting the next step's LR), so a run-time factor such as the spike
    guard's LR halving takes effect from the next scheduler step; call `refresh_lr` to apply it at once. That factor
    is not part of the step, so whoever owns it must checkpoint it. The multiplier is a closure, not a callable
    object, on purpose: LambdaLR.state_dict() would pickle an object's attributes (the config and extra_scale).
    """

    def multiplier(step: int) -> float:
        scale = extra_scale() if extra_scale is not None else 1.0
        return lr_multiplier(step, cfg) * rampup_lr_factor(step, cfg, dp) * scale

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def refresh_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> list[float]:
    """Recompute the current step's LR now (e.g. right after `extra_scale` changed) without advancing the step."""
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports; LambdaLR keeps no public setter
    return lrs
