"""The one place a guard's decision meets DeepSpeed: a gate on the optimizer's `step`.

Skipping an update cleanly under DeepSpeed means: parameters and Adam moments untouched, the LR schedule not
advanced, the loss scaler unchanged, every rank agreeing, for ZeRO 0-3 and the pipeline engine alike. All
engines end in the same call — the torch optimizer's `step()`, made after gradients are reduced, clipped and
the global norm is known — so Keel wraps exactly that call. When the decision is not to step, the wrapped
call returns without touching anything and flags the step as an overflow; DeepSpeed then treats it the way it
treats an fp16 overflow: gradients dropped, `skipped_steps` counted, LR scheduler not stepped.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from keel.training.guards.base import Action, Decision


def basic_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO / fp16 / bf16), or the engine's own."""
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def reported_grad_norm(engine) -> float | None:
    """The global norm DeepSpeed computed for this step (set before the inner step runs), if any."""
    norm = getattr(engine.optimizer, "_global_grad_norm", None)
    if norm is None:
        return None
    norm = float(norm)
    return math.nan if norm < 0 else norm  # DeepSpeed masks a non-finite norm as -1


class StepGate:
    """Wraps the inner optimizer's `step`; asks `decide()` once per optimizer step."""

    def __init__(self, engine, decide: Callable[[], Decision]):
        self.engine = engine
        self.decide = decide
        self.optimizer = basic_optimizer(engine)
        self._step = self.optimizer.step

        def gated_step(*args, **kwargs):
            return self._gated_step(*args, **kwargs)

        # torch's LR scheduler marks the step it wrapped; keep the mark so it does not warn about the gate
        gated_step._wrapped_by_lr_sched = getattr(self._step, "_wrapped_by_lr_sched", True)
        self.optimizer.step = gated_step
        self.token = 0  # bumped by the trainer before each optimizer step
        self._decided_token = -1
        self.decision = Decision()

    def new_step(self) -> None:
        self.token += 1
        self.decision = Decision()

    @property
    def consulted(self) -> bool:
        """False when DeepSpeed skipped the step before reaching the optimizer (its own overflow check)."""
        return self._decided_token == self.token

    def _gated_step(self, *args, **kwargs):
        if self._decided_token != self.token:  # ZeRO-3 calls step once per parameter sub-group
            self.decision = agree(self.decide())
            self._decided_token = self.token
        if self.decision.action == Action.STEP:
            self._set_overflow(False)
            return self._step(*args, **kwargs)
        self._set_overflow(True)
        return None

    def _set_overflow(self, value: bool) -> None:
        # DeepSpeed reads `engine.optimizer.overflow` right after the step to decide whether the LR scheduler
        # advances; the torch optimizer (ZeRO-0 fp32) gets the attribute too, as DeepSpeed's wrappers have it.
        self.engine.optimizer.overflow = value


def agree(decision: Decision) -> Decision:
    """Every rank acts on the most severe decision any rank reached (one scalar all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decision
    code = torch.tensor([int(decision.action)], dtype=torch.int64)
    dist.all_reduce(code, op=dist.ReduceOp.MAX)
    if int(code) == decision.action:
        return decision
    return Decision(Action(int(code)), reason="decided on another rank")
