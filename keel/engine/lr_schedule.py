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

from keel.adapters.torch_internals import set_last_lr
from keel.config import TrainConfig, validate_schedule_choices


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
    # a TrainConfig that skipped validation: the config's own error
    if cfg.lr_schedule not in AFTER_WARMUP:
        validate_schedule_choices(cfg)
    return AFTER_WARMUP[cfg.lr_schedule](step, cfg)


def _decay_to_floor(shape: float, cfg: TrainConfig) -> float:
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def _progress_after_warmup(step: int, cfg: TrainConfig) -> float:
    return min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))


def _cosine(step: int, cfg: TrainConfig) -> float:
    return _decay_to_floor(0.5 * (1.0 + math.cos(math.pi * _progress_after_warmup(step, cfg))), cfg)


def _linear(step: int, cfg: TrainConfig) -> float:
    return _decay_to_floor(1.0 - _progress_after_warmup(step, cfg), cfg)


def _constant(step: int, cfg: TrainConfig) -> float:
    return 1.0


def _inverse_sqrt(step: int, cfg: TrainConfig) -> float:
    return max(cfg.min_lr_ratio, math.sqrt(max(1, cfg.warmup_steps) / (step + 1)))


def _wsd(step: int, cfg: TrainConfig) -> float:
    decay_start = max(cfg.warmup_steps, cfg.steps - round(cfg.decay_fraction * cfg.steps))
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, cfg.steps - decay_start))
    return _decay_to_floor(1.0 - math.sqrt(progress), cfg)


# The multiplier after warmup, by train.lr_schedule; keyed by exactly keel.config.LR_SCHEDULES (tested).
AFTER_WARMUP: dict[str, Callable[[int, TrainConfig], float]] = {
    "cosine": _cosine,
    "linear": _linear,
    "constant": _constant,
    "inverse_sqrt": _inverse_sqrt,
    "wsd": _wsd,
}


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
    if cfg.rampup_lr_scaling not in RAMPUP_LR_FACTORS:  # a TrainConfig that skipped validation
        validate_schedule_choices(cfg)
    return RAMPUP_LR_FACTORS[cfg.rampup_lr_scaling](
        rampup_batch_size(step, cfg, dp) / cfg.global_batch_size
    )


# batch / global batch → LR factor, by train.rampup_lr_scaling; keyed by exactly keel.config.RAMPUP_SCALINGS.
RAMPUP_LR_FACTORS: dict[str, Callable[[float], float]] = {
    "linear": lambda ratio: ratio,
    "sqrt": math.sqrt,
    "none": lambda ratio: 1.0,
}


# -- the scheduler DeepSpeed steps ----------------------------------------------------------------------------
def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    dp: int = 1,
    extra_scale: Callable[[], float] | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
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
    lrs = [
        base * fn(scheduler.last_epoch)
        for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)
    ]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    set_last_lr(scheduler, lrs)
    return lrs
