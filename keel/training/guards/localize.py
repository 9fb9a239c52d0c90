"""Where a non-finite step went wrong: replay its micro-batches with hooks, then replay again to classify.

The step has already been skipped (the lead decides that); this only explains it. One replay runs every
micro-batch forward with hooks on every module and backward with `torch.autograd.grad`, and records, for each
micro-batch that turned non-finite, the first module whose output was non-finite (where the value was first
seen), the first module whose inputs were finite but output was not (where it was made), and the first
parameters whose gradients were non-finite. A second replay decides the class: the same finding twice is
"data" (the batch and the weights reproduce it; the samples are named), anything else is "transient" — unless
the weights or optimizer state are corrupt ("state", see `localize_on_all_ranks`): then no sample is to blame.

What the replay leaves alone, and why:
- DeepSpeed's state. It runs the plain model (`engine.module`), never the engine, and takes gradients with
  `torch.autograd.grad`, which returns them instead of accumulating: `.grad` is not written and the
  AccumulateGrad nodes ZeRO-1/2/3 hook for reduction never run (tests/test_localize.py checks both hooks).
- The training RNG. It runs in train mode, dropout as in training, under `fork_rng` (and with the
  sequence-parallel stream saved), so training continues with exactly the random numbers it would have drawn.
  The masks are therefore not the skipped step's, but both replays draw the same ones.

Collective rule: call `localize` on EVERY rank, each with its own micro-batches of the skipped step, or on none.
The replay runs the model's own collectives: tensor (and sequence) parallel all-reduces and gathers in forward
and backward, and under ZeRO-3 the parameter all-gathers over data parallel. Calling it only on the ranks that
saw the non-finite value hangs the others; "only when tp == 1" is not enough either, since ZeRO-3 gathers over
data parallel at any tp. Calling it everywhere is safe at any layout because every rank replays all its
micro-batches, twice, whatever it finds (no rank stops early on a local finding); it needs the skip decision to
be global, which it is. Each rank's result is about its own batch (under tp, its own shards); the lead combines
them (see `classify`). Pipeline parallelism is not supported: a `PipelineModule` stage cannot compute the loss.

ZeRO-3: afterwards call `engine.empty_partition_cache()`. The embedding's parameters are gathered in the replay
and only `engine.backward` releases them (their module's input needs no gradient, so DeepSpeed's post-backward
hook never fires); left gathered they make `GatheredParameters` (checkpoint saving, checksums) raise until the
next step. Also: the replay bypasses `engine.forward`, so a DeepSpeed `torch_autocast` section is not applied.

Memory: one micro-batch's activations plus one parameter's gradient at a time.
"""

from __future__ import annotations

import contextlib
import math
import socket
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from keel.adapters.deepspeed_internals import zero3_partition
from keel.parallel import comm

ROOT = "<model>"  # the name reported for the model itself (named_modules calls it "")
DATA, TRANSIENT, STATE = "data", "transient", "state"
MAX_BAD_GRADS = 5


@dataclass
class Finding:
    """What one replay saw in one micro-batch; only micro-batches with something non-finite get one."""

    micro_batch: int
    # first module, in execution order, with a non-finite output (None: forward fine)
    first_bad_module: str | None
    first_bad_class: str | None
    origin_module: str | None  # first module whose inputs were finite and whose output was not
    origin_class: str | None
    bad_rows: list[
        int
    ]  # rows of the micro-batch non-finite in first_bad_module's output ([]: not known)
    loss: float
    bad_grads: list[
        str
    ]  # up to MAX_BAD_GRADS parameters with a non-finite gradient, nearest the loss first
    n_bad_grads: int
    bad_params: list[
        str
    ]  # up to MAX_BAD_GRADS parameters whose values are non-finite (corrupt state, not data)

    @property
    def where(self) -> tuple[int, str | None]:
        """What must match between two replays for the finding to count as reproduced."""
        return self.micro_batch, self.first_bad_module


@dataclass
class Localization:
    """The answer for this rank, shaped for an anomalies.jsonl event (`AnomalyLog.record(kind, step, **event())`).

    The module and gradient fields come from the first bad micro-batch of the first replay that found one.
    """

    first_bad_module: str | None
    first_bad_class: str | None
    origin_module: str | None
    origin_class: str | None
    micro_batch: int | None
    loss: float | None
    bad_grads: list[str]
    n_bad_grads: int
    bad_params: list[str]
    bad_micro_batches: list[int]
    samples: list[
        int
    ]  # global sample indices of the bad rows (whole micro-batch where rows are not known)
    reproducible: bool
    classification: str
    replays_nonfinite: int  # how many of the two replays found something on this rank (0, 1 or 2)
    findings: list[Finding] = field(default_factory=list, repr=False)

    def event(self) -> dict[str, Any]:
        fields = asdict(self)
        del fields["findings"]
        return fields


def localize(
    model: nn.Module,
    micro_batches: Sequence[torch.Tensor],
    sample_indices: Sequence[int] | None = None,
    grad_scale: float = 1.0,
) -> Localization:
    """Replay the skipped step's micro-batches twice on `model` (the engine's `.module`) and explain them.

    Each micro-batch is a LongTensor [b, s+1]: inputs `batch[:, :-1]`, labels `batch[:, 1:]`, `model(inputs,
    labels)` the loss. `sample_indices` are this rank's global sample indices of the step in micro-batch order
    (`keel.data.step_sample_indices(...)`); given, the bad samples are named. `grad_scale` is what the step's
    backward multiplied the loss by (fp16: loss scale / gradient accumulation steps), so gradients overflow where
    the step's did. Collective: see the module docstring.
    """
    first = replay(model, micro_batches, grad_scale)
    second = replay(model, micro_batches, grad_scale)
    kind = classify(first, second)
    findings = first or second
    top = findings[0] if findings else None
    return Localization(
        first_bad_module=top.first_bad_module if top else None,
        first_bad_class=top.first_bad_class if top else None,
        origin_module=top.origin_module if top else None,
        origin_class=top.origin_class if top else None,
        micro_batch=top.micro_batch if top else None,
        loss=top.loss if top else None,
        bad_grads=top.bad_grads if top else [],
        n_bad_grads=top.n_bad_grads if top else 0,
        bad_params=top.bad_params if top else [],
        bad_micro_batches=[f.micro_batch for f in findings],
        samples=_samples(findings, micro_batches, sample_indices),
        reproducible=kind == DATA,
        classification=kind,
        replays_nonfinite=bool(first) + bool(second),
        findings=findings,
    )


def classify(first: list[Finding], second: list[Finding]) -> str:
    """The class on this rank: "data" when both replays found the same first bad module in the same micro-batch.

    - Both found it at the same place: the batch and the weights make it, every time → "data".
    - Neither found anything: the step's non-finite value did not come back → "transient". A replay cannot tell
      this from a healthy batch, so a rank whose own batch was fine also says "transient" with nothing found.
    - Mixed (one replay found it, the other not; or both, at different places): the same inputs gave different
      answers, so the samples are not to blame and the device or a nondeterministic kernel is → "transient".
      `replays_nonfinite == 1` marks this case: positive evidence against this rank, unlike finding nothing.

    Combining ranks (the lead's job): any rank with "data" makes the event data, with that rank's samples;
    otherwise it is transient, and the rank to name is the one whose own loss was non-finite in the step, or a
    rank with `replays_nonfinite == 1`.
    """
    if first and second and first[0].where == second[0].where:
        return DATA
    return TRANSIENT


def replay(
    model: nn.Module, micro_batches: Sequence[torch.Tensor], grad_scale: float = 1.0
) -> list[Finding]:
    """One replay of every micro-batch, in train mode, leaving RNG, `.grad` and DeepSpeed's hooks untouched."""
    if getattr(model, "num_stages", 1) > 1:
        raise ValueError(
            "localize: a pipeline stage cannot compute the loss alone; localization needs pp == 1"
        )
    named_params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    # ZeRO-3 keeps only this rank's partition outside forward; check that
    bad_params = [name for name, p in model.named_parameters() if not _finite(zero3_partition(p))]
    findings = []
    with (
        _training_rng_kept(model),
        _train_mode(model),
        torch.enable_grad(),
    ):  # even if called under no_grad
        for index, batch in enumerate(micro_batches):
            watch = _Watch(model, batch.shape[0])
            try:
                loss = model(batch[:, :-1], batch[:, 1:])
            finally:
                watch.remove()  # before backward: activation checkpointing re-runs forwards there
            # even from a non-finite loss: which grads?
            bad_grads = _bad_grads(loss * grad_scale, named_params)
            if watch.first is None and not bad_grads and _finite(loss):
                continue
            first_name, first_class = watch.first or (None, None)
            origin_name, origin_class = watch.origin or (None, None)
            findings.append(
                Finding(
                    index,
                    first_name,
                    first_class,
                    origin_name,
                    origin_class,
                    watch.first_rows,
                    loss.detach().float().item(),
                    bad_grads[:MAX_BAD_GRADS],
                    len(bad_grads),
                    bad_params[:MAX_BAD_GRADS],
                )
            )
    return findings


def _bad_grads(loss: torch.Tensor, named_params: list[tuple[str, nn.Parameter]]) -> list[str]:
    """Names of the parameters whose gradient is non-finite, nearest the loss first.

    `autograd.grad` returns the gradients instead of accumulating them: no `.grad`, no AccumulateGrad node, so
    none of the hooks ZeRO puts there. Each gradient is checked as it is made (a hook on the parameter) and
    handed back as a zero-strided scalar, so memory holds one parameter's gradient at a time rather than the
    whole model's (unpartitioned under ZeRO-2/3: the full replica, which the shard-sized training state was
    sized to avoid). Order: a non-finite value spreads to every gradient upstream of where it arose, so in
    forward (`named_parameters`) order the list would nearly always open with the embedding; reversed it
    approximates backward order and opens at the parameters nearest to where the gradient went bad.
    """
    if not named_params or not loss.requires_grad:
        return []
    bad: set[str] = set()

    def checked(name: str):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not _finite(grad):
                bad.add(name)
            return grad.new_zeros(()).expand_as(grad)  # what autograd.grad returns: no memory

        return hook

    handles = [p.register_hook(checked(name)) for name, p in named_params]
    try:
        torch.autograd.grad(loss, [p for _, p in named_params], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return [name for name, _ in reversed(named_params) if name in bad]


class _Watch:
    """Forward hooks on every module (the model included) recording the first non-finite output and origin.

    Hooks fire as modules return, so an inner module is seen before the module that called it: the first bad
    module is the innermost one that returned a non-finite value first. Input finiteness is taken before the
    forward runs (a module may work in place on its input).
    """

    def __init__(self, model: nn.Module, batch_size: int):
        self.batch_size = batch_size
        self.first: tuple[str, str] | None = None
        self.first_rows: list[int] = []
        self.origin: tuple[str, str] | None = None
        self._inputs_finite: list[bool | None] = []  # a stack: modules nest
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._make_post(name or ROOT)))

    @property
    def done(self) -> bool:
        return self.first is not None and self.origin is not None

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._inputs_finite.append(None if self.done else _finite(args) and _finite(kwargs))

    def _make_post(self, name: str):
        def post(module: nn.Module, args: tuple, output: Any) -> None:
            inputs_finite = self._inputs_finite.pop()
            if inputs_finite is None or self.done:
                return
            bad = next((t for t in _tensors(output) if not _finite(t)), None)
            if bad is None:
                return
            where = (name, type(module).__name__)
            if self.first is None:
                self.first, self.first_rows = where, self._rows(bad)
            if inputs_finite and self.origin is None:
                self.origin = where

        return post

    @torch.no_grad()
    def _rows(self, t: torch.Tensor) -> list[int]:
        """Rows of a [b, s, ...] activation holding non-finite values; [] for anything else (e.g. the loss)."""
        if t.ndim < 3 or t.shape[0] != self.batch_size:
            return []
        return (~torch.isfinite(t)).reshape(t.shape[0], -1).any(dim=1).nonzero().flatten().tolist()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


@torch.no_grad()  # isfinite decomposes into differentiable ops: under activation checkpointing, anything they
def _finite(
    obj: Any,
) -> bool:  # saved for backward would change the count checkpoint compares in recompute
    """True when every floating-point tensor in `obj` (a tensor or nested lists/tuples/dicts) is finite."""
    return all(
        bool(torch.isfinite(t).all())
        for t in _tensors(obj)
        if t.is_floating_point() or t.is_complex()
    )


@contextlib.contextmanager
def _train_mode(model: nn.Module) -> Iterator[None]:
    """Train mode for the replay (dropout as in the step), each module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def _training_rng_kept(model: nn.Module) -> Iterator[None]:
    """Fork the default CPU and current-GPU streams, and save the sequence-parallel dropout stream (Keel's
    `ShardedRNG`, reached through the layers' `tp` contexts), so the replay draws nothing from training's RNG."""
    sharded = {
        id(rng): rng
        for m in model.modules()
        if (rng := getattr(getattr(m, "tp", None), "sharded_rng", None))
    }
    saved = {key: rng.state_dict() for key, rng in sharded.items()}
    use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if use_cuda else []):
            yield
    finally:
        for key, rng in sharded.items():
            rng.load_state_dict(saved[key])


def _samples(
    findings: list[Finding],
    micro_batches: Sequence[torch.Tensor],
    sample_indices: Sequence[int] | None,
) -> list[int]:
    if sample_indices is None:
        return []
    starts = [0]
    for batch in micro_batches:
        starts.append(starts[-1] + batch.shape[0])
    samples = []
    for f in findings:
        rows = f.bad_rows or range(micro_batches[f.micro_batch].shape[0])
        samples.extend(int(sample_indices[starts[f.micro_batch] + row]) for row in rows)
    return samples


def localize_on_all_ranks(
    model: nn.Module,
    micro_batches: Sequence[torch.Tensor],
    samples: Sequence[int],
    local_loss: float | None,
    control: comm.Group,
    fixed_batch: torch.Tensor | None = None,
    bad_state: tuple[int, list[str]] = (0, []),
) -> dict[str, Any]:
    """Every rank replays its own micro-batches of the skipped step; the findings are gathered (over the world's
    control channel) and combined into one summary all ranks hold (a collective: call on every rank).

    Telling corrupt state from data: every rank also replays `fixed_batch` (a validation micro-batch, innocent by
    construction), and brings `bad_state`, its own check of its weights and optimizer state (guards/state.py:
    the count of non-finite tensors, some of their names). Either one non-finite on any rank makes the step
    "state". The fixed batch is replayed whatever the step's replays found: every rank must run the same replays
    (their collectives), and deciding first would take a second gather for a one-micro-batch saving."""
    event = localize(model, micro_batches, samples).event()
    fixed = bool(replay(model, [fixed_batch])) if fixed_batch is not None else False
    return combine_rank_findings(
        comm.all_gather_object(
            {
                **event,
                "local_loss": local_loss,
                "host": socket.gethostname(),
                "fixed_batch_nonfinite": fixed,
                "bad_state": bad_state[0],
                "bad_state_tensors": bad_state[1],
            },
            control,
        )
    )


def combine_rank_findings(found: list[dict[str, Any]]) -> dict[str, Any]:
    """Corrupt state on any rank (its own check, or the fixed batch non-finite) makes the step "state", no samples
    blamed; otherwise the first rank whose batch reproduces the fault names it ("data"); otherwise it was
    transient, on the ranks whose replays or own loss saw a non-finite value."""
    state = [
        rank for rank, e in enumerate(found) if e.get("bad_state") or e.get("fixed_batch_nonfinite")
    ]
    if state:
        return {
            "classification": STATE,
            "bad_ranks": state,
            "hosts": [found[r].get("host") for r in state],
            "fixed_batch_nonfinite": [r for r in state if found[r].get("fixed_batch_nonfinite")],
            "bad_state": {
                str(r): found[r]["bad_state_tensors"] for r in state if found[r].get("bad_state")
            },
            "replay_reproduced": any(e["classification"] == DATA for e in found),
        }
    data = [(rank, e) for rank, e in enumerate(found) if e["classification"] == DATA]
    if data:
        rank, event = data[0]
        return {**event, "classification": DATA, "bad_rank": rank}
    flaky = [
        rank
        for rank, e in enumerate(found)
        if e["replays_nonfinite"] or not math.isfinite(e["local_loss"] or 0.0)
    ]
    return {
        "classification": TRANSIENT,
        "bad_ranks": flaky,
        "hosts": [found[r].get("host") for r in flaky],
    }
