"""The one seam where the trainer's decision reaches DeepSpeed's update: a gate on the torch optimizer's `step`.

Guards need the step's global gradient norm, which DeepSpeed computes inside its own step (after reducing the
gradients, before the update); the pipeline engine runs forward, backward and step in one `train_batch` call.
So the trainer cannot decide between backward and step, and instead hands the gate its decision function for
the duration of the step (`with gate.deciding(trainer._decide): ...`). Every engine — ZeRO 0-3, bf16, fp16, the
pipeline — ends in the torch optimizer's `step()`; the gate wraps exactly that call, asks once, agrees the answer
across ranks, and either steps or vetoes. The agreement is the step's one control collective: it carries the
stop's exit code, a data stop's sample (keel/training/data_stop.py) and the preemption flag too, and a step
DeepSpeed dropped before asking (fp16 overflow) is agreed by `agree_unconsulted`. A veto leaves parameters, Adam
moments, the LR schedule and the loss scaler untouched: DeepSpeed treats it as it treats an fp16 overflow
(gradients dropped, `skipped_steps` counted, scheduler held). The DeepSpeed internals this needs live in
keel/adapters/deepspeed_internals/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from keel.adapters.deepspeed_internals import inner_optimizer, veto_step
from keel.adapters.torch_internals import keep_scheduler_mark
from keel.parallel import comm
from keel.training.guards.base import Action, Decision


class StepGate:
    def __init__(self, engine, control: comm.Group, signalled: Callable[[], bool] = lambda: False):
        """`control`: the world's control channel; `signalled()`: this rank's preemption flag, agreed each step."""
        self.engine = engine
        self.control = control
        self.signalled = signalled
        # agreed: some rank was signalled by the time of this step's agreement
        self.preempted = False
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
            raise RuntimeError(
                "the optimizer stepped outside StepGate.deciding(): the guards were not asked"
            )
        # ZeRO-3 calls step once per parameter sub-group: decide once per step
        if not self.consulted:
            self.decision, self.preempted = agree(self._decide(), self.signalled(), self.control)
            self.consulted = True
        vetoed = self.decision.action != Action.STEP
        veto_step(self.engine, vetoed)
        return None if vetoed else self._step(*args, **kwargs)

    def agree_unconsulted(self, decision: Decision) -> Decision:
        """The agreement for a step the engine dropped before asking the gate (its fp16 overflow handling)."""
        self.decision, self.preempted = agree(decision, self.signalled(), self.control)
        return self.decision


# An agreed sample index travels as _NO_SAMPLE - index, so MAX picks the lowest index and 0 means none.
_NO_SAMPLE = 2**62


def agree(decision: Decision, signalled: bool, control: comm.Group) -> tuple[Decision, bool]:
    """Every rank acts on the most severe decision any rank reached, with the highest exit code any rank chose, and
    stops if any rank was signalled; a data stop's sample (the lowest, when several ranks saw one) reaches every
    rank, which names it the same way (keel/training/data_stop.py). One four-element all-reduce (MAX) on the control
    channel."""
    sample = 0 if decision.sample is None else _NO_SAMPLE - decision.sample
    codes = torch.tensor(
        [int(decision.action), int(signalled), decision.exit_code, sample], dtype=torch.int64
    )
    action, preempted, exit_code, sample = comm.all_reduce(codes, control, "max").tolist()
    agreed_sample = None if sample == 0 else _NO_SAMPLE - sample
    if action == decision.action:  # keep this rank's own reason
        return replace(decision, exit_code=exit_code, sample=agreed_sample), bool(preempted)
    return Decision(
        Action(action), reason="decided on another rank", exit_code=exit_code, sample=agreed_sample
    ), bool(preempted)
