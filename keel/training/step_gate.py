"""The one seam where the trainer's decision reaches DeepSpeed's update: a gate on the torch optimizer's `step`.

Guards need the step's global gradient norm, which DeepSpeed computes inside its own step (after reducing the
gradients, before the update); the pipeline engine runs forward, backward and step in one `train_batch` call.
So the trainer cannot decide between backward and step, and instead hands the gate its decision function for
the duration of the step (`with gate.deciding(trainer._decide): ...`). Every engine — ZeRO 0-3, bf16, fp16, the
pipeline — ends in the torch optimizer's `step()`; the gate wraps exactly that call, asks once, agrees the answer
across ranks, and either steps or vetoes. A veto leaves parameters, Adam moments, the LR schedule and the loss
scaler untouched: DeepSpeed treats it as it treats an fp16 overflow (gradients dropped, `skipped_steps` counted,
scheduler held). The DeepSpeed internals this needs live in keel/adapters/deepspeed_internals.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from keel.adapters.deepspeed_internals import inner_optimizer, veto_step
from keel.adapters.torch_internals import keep_scheduler_mark
from keel.training.guards.base import Action, Decision


class StepGate:
    def __init__(self, engine):
        self.engine = engine
        self.optimizer = inner_optimizer(engine)
        self._step = self.optimizer.step

        def gated_step(*args, **kwargs):
            return self._gated_step(*args, **kwargs)

        keep_scheduler_mark(gated_step, self._step)
        self.optimizer.step = gated_step
        self._decide: Callable[[], Decision] | None = None
        self.decision = Decision()
        self.consulted = False  # False after a step DeepSpeed dropped before reaching the optimizer (its overflow)

    @contextmanager
    def deciding(self, decide: Callable[[], Decision]) -> Iterator[StepGate]:
        """Within the block, the engine's optimizer step asks `decide()` once and acts on the agreed answer."""
        self._decide, self.decision, self.consulted = decide, Decision(), False
        try:
            yield self
        finally:
            self._decide = None

    def _gated_step(self, *args, **kwargs):
        if self._decide is None:
            raise RuntimeError("the optimizer stepped outside StepGate.deciding(): the guards were not asked")
        if not self.consulted:  # ZeRO-3 calls step once per parameter sub-group: decide once per step
            self.decision = agree(self._decide())
            self.consulted = True
        vetoed = self.decision.action != Action.STEP
        veto_step(self.engine, vetoed)
        return None if vetoed else self._step(*args, **kwargs)


def agree(decision: Decision) -> Decision:
    """Every rank acts on the most severe decision any rank reached (one scalar all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decision
    code = torch.tensor([int(decision.action)], dtype=torch.int64)
    dist.all_reduce(code, op=dist.ReduceOp.MAX)
    if int(code) == decision.action:
        return decision
    return Decision(Action(int(code)), reason="decided on another rank")
