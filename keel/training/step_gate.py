"""The one seam where the trainer's decision reaches DeepSpeed's update: a gate on the torch optimizer's `step`.

Guards need the step's global gradient norm, which DeepSpeed computes inside its own step (after reducing the
gradients, before the update); the pipeline engine runs forward, backward and step in one `train_batch` call.
So the trainer cannot decide between backward and step, and instead hands the gate its decision function for
the duration of the step (`with gate.deciding(trainer._decide): ...`). Every engine — ZeRO 0-3, bf16, fp16, the
pipeline — ends in the torch optimizer's `step()`; the gate wraps exactly that call, asks once, and either steps
or vetoes. A veto leaves parameters, Adam moments, the LR schedule and the loss scaler untouched: DeepSpeed
treats it as it treats an fp16 overflow (gradients dropped, `skipped_steps` counted, scheduler held). The
DeepSpeed internals this needs live in keel/adapters/deepspeed_internals/.

Every rank acts on the same decision without a collective of its own: what only one rank knows — its batch's bad
sample (keel/training/data_stop.py), its preemption signal, whether its background save is still being written
— is agreed by `post_agreement`, one small all-reduce on the device channel the trainer issues beside the step's
loss reduction and reads back in the same transfer (`decode`); the guards then decide on values every rank
holds alike (the reduced loss, the global norm) — the same decision everywhere. A rank-local decision travels
whole (`encode`): every rank receives one rank's decision, not a mix of several.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from keel.adapters.deepspeed_internals import inner_optimizer, veto_step
from keel.adapters.torch_internals import keep_scheduler_mark
from keel.parallel import comm
from keel.run_dir import step_of, tag_for
from keel.training.guards.base import Action, Decision


@dataclass(frozen=True)
class Agreed:
    """What every rank acts on for one step."""

    decision: Decision
    preempted: bool = False  # some rank was signalled
    writing: bool = False  # some rank's background save writer was still writing
    # every rank's newest in-memory snapshot is whole (memory.py may drop the older ones); False when unknown
    snapshots_settled: bool = False


class StepGate:
    def __init__(self, engine):
        self.engine = engine
        self.optimizer = inner_optimizer(engine)
        self._step = self.optimizer.step

        def gated_step(*args, **kwargs):
            return self._gated_step(*args, **kwargs)

        keep_scheduler_mark(gated_step, self._step)
        self.optimizer.step = gated_step
        self._decide: Callable[[], Agreed] | None = None
        self.agreed = Agreed(Decision())
        self.consulted = False  # False after a step DeepSpeed dropped before reaching the optimizer (its overflow)

    @property
    def decision(self) -> Decision:
        return self.agreed.decision

    @property
    def preempted(self) -> bool:
        """Some rank was signalled by the time of this step's agreement."""
        return self.agreed.preempted

    @contextmanager
    def deciding(self, decide: Callable[[], Agreed]) -> Iterator[StepGate]:
        """Within the block, the engine's optimizer step asks `decide()` once and acts on its answer (the same on
        every rank)."""
        self._decide, self.agreed, self.consulted = decide, Agreed(Decision()), False
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
            self.agreed = self._decide()
            self.consulted = True
        vetoed = self.decision.action != Action.STEP
        veto_step(self.engine, vetoed)
        return None if vetoed else self._step(*args, **kwargs)

    def unconsulted(self, agreed: Agreed) -> Decision:
        """The answer for a step the engine dropped before asking the gate (its fp16 overflow handling)."""
        self.agreed = agreed
        return self.decision


# The agreement is one all-reduce (MAX) of int64s. A decision's fields travel behind a key that orders ranks by
# the severity of their action, then by lowest rank: the MAX of `key << _FIELD_BITS | field` is the winning rank's
# field, so every rank receives one rank's whole decision (its checkpoint, restore and data rewind) — not a mix.
AGREEMENT_FIELDS = 7  # the agreement's int64s (encode's order)
_RANK_BITS = 20  # up to 1,048,576 ranks
_FIELD_BITS = 40  # a checkpoint's step, up to 10^12
assert max(Action) < 2 ** (63 - _FIELD_BITS - _RANK_BITS)  # the keyed words stay positive int64s
# An agreed sample index travels as _NO_SAMPLE - index, so MAX picks the lowest index and 0 means none.
_NO_SAMPLE = 2**62


def encode(
    decision: Decision, signalled: bool, rank: int, writing: bool = False, snapshot: int = 0
) -> torch.Tensor:
    """What `rank` sends to the agreement: [keyed checkpoint step, keyed flags, signalled, exit code, sample,
    writing, snapshot] (`snapshot`: MemoryCheckpoints.state: 0 whole, 1 its last one failed, 2 in flight)."""
    if not 0 <= rank < 2**_RANK_BITS:
        raise ValueError(
            f"the step agreement addresses up to {2**_RANK_BITS} ranks, not rank {rank}"
        )
    key = (int(decision.action) << _RANK_BITS) | (2**_RANK_BITS - 1 - rank)
    to = 0 if decision.to is None else step_of(decision.to) + 1
    flags = int(decision.restore) << 1 | int(decision.rewind_data)
    sample = 0 if decision.sample is None else _NO_SAMPLE - decision.sample
    return torch.tensor(
        [
            key << _FIELD_BITS | to,
            key << _FIELD_BITS | flags,
            int(signalled),
            decision.exit_code,
            sample,
            int(writing),
            snapshot,
        ],
        dtype=torch.int64,
    )


def decode(agreed: list[int], own: Decision, rank: int) -> Agreed:
    """What every rank acts on, from the agreement's MAX: the winning rank's whole decision (`own`, with its
    reason, on that rank), the highest exit code, the lowest data-stop sample; whether any rank was signalled,
    whether any rank's background save writer was still writing, and whether every rank's in-memory snapshot is
    whole."""
    keyed_to, keyed_flags, preempted, exit_code, sample, writing, snapshot = agreed
    settled = snapshot == 0
    key = keyed_to >> _FIELD_BITS
    winner = 2**_RANK_BITS - 1 - (key & (2**_RANK_BITS - 1))
    agreed_sample = None if sample == 0 else _NO_SAMPLE - sample
    if winner == rank:  # keep this rank's own reason
        mine = replace(own, exit_code=exit_code, sample=agreed_sample)
        return Agreed(mine, bool(preempted), bool(writing), settled)
    to = keyed_to & (2**_FIELD_BITS - 1)
    flags = keyed_flags & (2**_FIELD_BITS - 1)
    theirs = Decision(
        Action(key >> _RANK_BITS),
        reason=f"decided on rank {winner}",
        exit_code=exit_code,
        restore=bool(flags >> 1 & 1),
        sample=agreed_sample,
        rewind_data=bool(flags & 1),
        to=tag_for(to - 1) if to else None,
    )
    return Agreed(theirs, bool(preempted), bool(writing), settled)


def post_agreement(
    decision: Decision,
    signalled: bool,
    writing: bool,
    group: comm.Group,
    device,
    snapshot: int = 0,
) -> torch.Tensor:
    """Start the agreement over `group` (the world's device channel in training): one seven-element all-reduce
    (MAX), left unread on `device` for the caller's one read-back of the step (`decode` reads it)."""
    codes = encode(decision, signalled, group.rank, writing, snapshot).to(device, non_blocking=True)
    return comm.all_reduce(codes, group, "max")
