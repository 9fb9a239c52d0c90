"""Corrupt training state is not bad data: each rank checks what it holds of the truth for non-finite values.

A non-finite step is usually a bad batch (skipped, its samples named) or a transient fault (skipped). When the
weights or the optimizer state themselves hold a NaN or an inf, skipping is wrong three ways: every later batch is
blamed, the run goes on from poisoned state, and a checkpoint saved from it replaces good ones. So this check runs

- on every non-finite step, next to localize.py's replays (plus one replay of a fixed validation micro-batch):
  either finding makes the step "state", which rolls back instead of skipping (`corrupt_state_decision`);
- before every save (`CorruptStateGuard.allows_save`): a refused save writes nothing, and a run that ends so
  exits ExitCode.CORRUPT_STATE.

What a rank holds of the truth (`state_tensors`): the inner torch optimizer's parameters — the fp32 master
partition under ZeRO-1/2/3, bf16 and fp16, the parameters themselves at fp32 ZeRO-0 — and their per-element state
(Adam's moments), plus the working parameters the rank holds (its partition under ZeRO-3, the whole working copy
otherwise: the model file of a checkpoint is written from it). Nothing is gathered.

Cost: a min/max reduction (`torch.aminmax`, which propagates NaN and keeps an inf) per chunk of CHUNK elements, so
no temporary beyond two scalars per chunk, and one read-back per device per check; it is bounded by memory
bandwidth (bench/state_check.py measures it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from keel.adapters.deepspeed_internals import inner_optimizer, zero3_partition
from keel.parallel import comm
from keel.parallel.topology import Topology
from keel.run_dir import AnomalyLog, ExitCode
from keel.training.guards.base import Action, Decision

log = logging.getLogger("keel")

# elements per reduction: bounds any kernel workspace, large enough to stay bandwidth-bound
CHUNK = 1 << 24
MAX_NAMED = 8  # corrupt tensors named per rank in an event (the count is always exact)


def state_tensors(engine) -> Iterator[tuple[str, torch.Tensor]]:
    """(label, tensor) for everything this rank holds of the training state, each tensor once."""
    seen: set[tuple[int, int]] = set()
    names = {id(p): name for name, p in engine.module.named_parameters()}

    def first_time(t: torch.Tensor) -> bool:
        key = (t.data_ptr(), t.numel())
        fresh = key not in seen and t.numel() > 0 and t.is_floating_point()
        seen.add(key)
        return fresh

    optimizer = inner_optimizer(engine)
    # ZeRO-3 lists a sub-group's flat fp32 partition in `param_groups` only while stepping it; `state` keeps it
    stepped = [p for group in optimizer.param_groups for p in group["params"]] + list(
        optimizer.state
    )
    for i, param in enumerate(dict.fromkeys(stepped)):
        where = names.get(id(param), f"flat {i}")
        if first_time(param.data):
            yield f"master {where}", param.data
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and first_time(value):
                yield f"{key} {where}", value
    for name, param in engine.module.named_parameters():
        working = zero3_partition(param).data
        if first_time(working):
            yield f"param {name}", working


@torch.no_grad()
def nonfinite_state(engine) -> tuple[int, list[str]]:
    """(how many of this rank's state tensors hold a non-finite value, the first MAX_NAMED of their labels).
    Local: no collective; one host read-back per device the state lives on (offloaded state: two)."""
    labels: list[str] = []
    flags: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for label, tensor in state_tensors(engine):
        flags.setdefault(tensor.device, []).append((len(labels), _nonfinite(tensor)))
        labels.append(label)
    bad = sorted(
        index
        for on_device in flags.values()
        for (index, _), flag in zip(on_device, torch.stack([f for _, f in on_device]).tolist())
        if flag
    )
    return len(bad), [labels[i] for i in bad[:MAX_NAMED]]


def _nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    """A device bool: does `tensor` hold a NaN or an inf? Min and max per chunk, never a tensor-sized temporary."""
    if tensor.is_contiguous():
        flat, step = tensor.view(-1), CHUNK
    else:  # a strided view: chunks of whole rows, reduced in place (never copied)
        flat, step = tensor, max(1, CHUNK // max(1, tensor[0].numel()))
    extremes = [
        torch.stack(torch.aminmax(flat[i : i + step])) for i in range(0, flat.shape[0], step)
    ]
    return ~torch.isfinite(torch.cat(extremes) if len(extremes) > 1 else extremes[0]).all()


class CorruptStateGuard:
    """Decides what corrupt state calls for, and gates every save on its absence (see the module docstring).

    Every method is a collective over the world's control channel (the rollback choice through
    `agreed_checkpoint`, the checkpointer's agreement), called on every rank at the same point."""

    def __init__(
        self,
        engine,
        agreed_checkpoint: Callable[[int], str | None],
        topology: Topology,
        anomalies: AnomalyLog,
    ):
        """`agreed_checkpoint(step)`: the newest intact checkpoint at or before `step` that every rank sees (a
        collective), None if there is none — the guard names where to return, the trainer goes there."""
        self.engine = engine
        self.agreed_checkpoint = agreed_checkpoint
        self.control = topology.control("world")
        self.rank = topology.rank
        self.anomalies = anomalies
        # the checkpoint the last corrupt-state rollback returned to
        self.returned_to: str | None = None

    def check_here(self) -> tuple[int, list[str]]:
        """This rank's own check (local): (non-finite tensors, the first MAX_NAMED of their labels)."""
        return nonfinite_state(self.engine)

    def ranks_with_it(self, found_here: tuple[int, list[str]]) -> int:
        """How many ranks found corrupt state: one one-integer all-reduce."""
        count, labels = found_here
        if count:
            log.error(
                "rank %d holds non-finite state in %d tensor(s): %s",
                self.rank,
                count,
                ", ".join(labels),
            )
        return int(
            comm.all_reduce(
                torch.tensor([int(count > 0)], dtype=torch.int64), self.control, "sum"
            ).item()
        )

    def allows_save(self, step: int) -> bool:
        """Before every save: True when every rank's state is finite. A refused save must write nothing — the
        caller returns before any checkpoint is written — so the last good checkpoint stays `latest`."""
        bad_ranks = self.ranks_with_it(self.check_here())
        if bad_ranks:
            self.anomalies.record(
                "corrupt_state",
                step,
                phase="save",
                ranks_with_corrupt_state=bad_ranks,
                action="save refused",
            )
            if self.rank == 0:
                log.error(
                    "step %d: checkpoint save refused: %d rank(s) hold non-finite weights or optimizer "
                    "state; the last good checkpoint stays latest",
                    step,
                    bad_ranks,
                )
        return bad_ranks == 0

    def refused_save(self, step: int, ending: bool) -> Decision:
        """After a refused save: a run that was ending stops with ExitCode.CORRUPT_STATE (its last good checkpoint
        stays latest); otherwise it returns to that checkpoint (`decide`)."""
        reason = "non-finite weights or optimizer state at a checkpoint save"
        if ending:
            return Decision(
                Action.STOP,
                f"{reason}: the last good checkpoint stays latest",
                exit_code=ExitCode.CORRUPT_STATE,
            )
        return self.decide(step, reason)

    def decide(self, step: int, reason: str, **event) -> Decision:
        """The rollback (or stop) for corrupt state found at `step`; `event` goes to anomalies.jsonl (no
        samples: they were innocent)."""
        tag = self.agreed_checkpoint(step - 1)  # rank 0 chooses, every rank verifies
        decision = corrupt_state_decision(
            tag, again=tag is not None and tag == self.returned_to, reason=reason
        )
        if decision.action == Action.ROLLBACK:
            self.returned_to = tag
        self.anomalies.record(
            "corrupt_state",
            step,
            action=decision.action.name.lower(),
            reason=decision.reason,
            checkpoint=tag,
            **event,
        )
        log.error("step %d: %s", step, decision.reason)
        return decision


def corrupt_state_decision(returns_to: str | None, again: bool, reason: str) -> Decision:
    """What corrupt state calls for: a rollback that rewinds the data (the samples were innocent) and keeps the
    LR; a stop with ExitCode.CORRUPT_STATE when there is no checkpoint to return to, or when the state went bad again
    after a rollback to the same checkpoint (`again`)."""
    if returns_to is None:
        return Decision(
            Action.STOP,
            f"{reason}, and no checkpoint to return to",
            exit_code=ExitCode.CORRUPT_STATE,
        )
    if again:
        return Decision(
            Action.STOP,
            f"{reason} again after rolling back to {returns_to}",
            exit_code=ExitCode.CORRUPT_STATE,
        )
    return Decision(Action.ROLLBACK, reason, restore=True, rewind_data=True, to=returns_to)
