"""The training loop, one screen: fetch → forward/backward → the guards' one agreed decision → apply → metrics →
periodic checks → checkpoint.

The data position is the global number of consumed samples, so the loop is the same at any data-parallel size
and a resume continues with exactly the samples an uninterrupted run would have used. Guards decide, the trainer
acts: the step's decision is taken inside the engine's step (after gradient reduction, before the update) through
keel/training/step_gate.py; the periodic cross-rank checks decide after it; the loop skips, rolls back or stops.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from keel.adapters.deepspeed_internals import (
    host_grad_norm,
    loss_scale,
    pipeline_summed_loss,
    raw_grad_norm_before_update,
)
from keel.config import RunConfig
from keel.data import (
    GlobalSampleOrder,
    PackedSamples,
    parse_skip_ranges,
    skip_to,
    step_batch,
    step_sample_indices,
)
from keel.data.token_check import first_bad_row
from keel.engine.build import Fp32GradClipper, LRScale
from keel.engine.ds_config import engine_batch_copies
from keel.engine.lr_schedule import rampup_batch_size
from keel.parallel import comm
from keel.parallel.topology import Topology
from keel.run_dir import AnomalyLog, ExitCode, checkpoint_dir
from keel.run_dir.bad_nodes import record_bad_node
from keel.training.checkpoint.memory import MemoryCheckpoints
from keel.training.checkpoint.seam import RunCheckpoints
from keel.training.checkpoint.store import Checkpointer, TrainState
from keel.training.data_stop import check_step_batch, named_stop, with_data_stop
from keel.training.faults import FaultInjector
from keel.training.guards.base import Action, Decision, StepStats
from keel.training.guards.localize import STATE, localize_on_all_ranks
from keel.training.guards.stack import GuardStack
from keel.training.guards.state import CorruptStateGuard
from keel.training.observe import timeline
from keel.training.observe.attention_logits import AttentionLogitWarning
from keel.training.observe.expert_health import ExpertHealth
from keel.training.observe.fp8_health import Fp8HealthWarning
from keel.training.observe.metrics import MetricsWriter
from keel.training.observe.monitor import ModelMonitor
from keel.training.observe.progress import run_progress
from keel.training.observe.sinks import Sinks
from keel.training.observe.sync_debug import SyncCounter
from keel.training.observe.timeline import StartupClock
from keel.training.observe.watchdog import StragglerMonitor, StragglerReport, Watchdog
from keel.training.preemption import PreemptionHandler
from keel.training.prefetch import BatchPrefetcher
from keel.training.step_gate import Agreed, StepGate, decode, post_agreement

log = logging.getLogger("keel")


@dataclass
class TrainResult:
    state: TrainState
    finished: bool  # reached train.steps (False: stopped early by train.exit_after or a guard)
    exit_code: int = 0
    reason: str = ""


@dataclass
class StepBatch:
    """What one optimizer step consumes: this rank's micro-batches of global samples [start, start + size)."""

    step: int
    start: int
    size: int
    micro_batches: list[torch.Tensor] = field(default_factory=list)
    loss: float = float("nan")  # the data-parallel mean, once known
    # (this rank's loss or None, the data-parallel mean) as device scalars, until the step's one read-back
    device_losses: tuple[torch.Tensor | None, torch.Tensor] | None = None
    # the global norm the guards decided on (None: not known on this path)
    grad_norm: float | None = None
    # this rank's batch held ids outside the vocabulary (keel/training/data_stop.py)
    data_stop: Decision | None = None
    # the step's agreement (step_gate.post_agreement) on the device until the read-back, then what it agreed
    device_agreement: torch.Tensor | None = None
    agreed: Agreed | None = None
    # the background save pending when the agreement was posted (its tag), if any
    saving: str | None = None

    @property
    def end(self) -> int:
        return self.start + self.size


def _device_mean(value: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """The mean over `group` of a device scalar, left on the device."""
    return comm.all_reduce(value.clone(), group) / group.size


def _read_back(
    *values: torch.Tensor | float | None, codes: torch.Tensor | None = None
) -> tuple[list[float | None], list[int]]:
    """Device scalars to host floats, and the int64 `codes` to host ints, in one transfer (each `.item()` would
    stall the device on its own): the floats travel as their float64 bits beside the codes. Floats and None pass
    through."""
    tensors = [
        v.detach().reshape(1).to(torch.float64) for v in values if isinstance(v, torch.Tensor)
    ]
    words = [t.view(torch.int64) for t in tensors] + (
        [codes.reshape(-1)] if codes is not None else []
    )
    host = torch.cat(words).tolist() if words else []
    n = len(tensors)
    floats = iter(struct.unpack(f"<{n}d", struct.pack(f"<{n}q", *host[:n])))
    read = [next(floats) if isinstance(v, torch.Tensor) else v for v in values]
    return read, host[n:]


@contextlib.contextmanager
def _clock(record: dict, key: str) -> Iterator[None]:
    """Add the body's wall time to `record[key]` (phases between steps are costs too, not hidden)."""
    start = time.perf_counter()
    yield
    record[key] = record.get(key, 0.0) + time.perf_counter() - start


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        engine,
        topology: Topology,
        train_samples: PackedSamples,
        val_samples: PackedSamples,
        run_dir: Path,
        lr_scale: LRScale | None = None,
        order=None,
        checkpointer: Checkpointer | None = None,
        startup: StartupClock | None = None,
        memory: MemoryCheckpoints | None = None,
    ):
        """`startup`: this run's start-up phases so far (keel/training/entry.py); the trainer adds the restore
        and the first step, and rank 0 writes them to the run's timeline."""
        self.cfg = cfg
        self.startup = startup or StartupClock(time.time(), before="other")
        self._startup_recorded = False
        self.engine = engine
        self.topology = topology
        self.train_samples = train_samples
        self.val_samples = val_samples
        # a blend's order (keel/data/blend.py) or the single source's
        self.order = order or GlobalSampleOrder(len(train_samples), cfg.train.seed)
        self.anomalies = AnomalyLog(run_dir, topology.rank)
        self.checkpointer = checkpointer or Checkpointer(
            checkpoint_dir(run_dir, cfg, topology.rank),
            cfg.checkpoint.keep_last,
            topology,
            self.anomalies,
        )
        self.run_dir = run_dir
        self.dp_group = topology.device("dp")
        self.is_pipeline = cfg.parallel.pp > 1
        self.lr_scale = lr_scale or LRScale()
        self.clipper = Fp32GradClipper(engine, topology)
        self.skip_ranges = parse_skip_ranges(cfg.data.skip_ranges)
        train = cfg.train
        self.prefetcher = BatchPrefetcher(
            lambda start, size: step_batch(
                self.order,
                train_samples,
                start,
                size,
                train.micro_batch_size,
                topology.dp_rank,
                topology.dp_size,
                checked=False,
            ),
            pin=torch.device(engine.device).type == "cuda",
            # every id within the vocabulary: a min/max of the host batch on the prefetch worker (data_stop.py)
            check=lambda batches: first_bad_row(batches, train_samples.vocab_size),
        )
        self.faults = FaultInjector(
            cfg.faults, topology.rank, engine, cfg.model.vocab_size, cfg.train.seed
        )
        self.loss_fn = engine.module.loss_fn
        self.guards = GuardStack(cfg, engine, topology, self.anomalies)
        self.corrupt_state = CorruptStateGuard(
            engine, self.checkpointer.agreed_at_or_before, topology, self.anomalies
        )
        self.checkpoints = RunCheckpoints(
            cfg,
            engine,
            self.checkpointer,
            self.anomalies,
            self.guards,
            self.corrupt_state,
            self.faults,
            self.lr_scale,
            memory,
        )
        self.preemption = PreemptionHandler()
        self.gate = StepGate(engine)
        # the background save the last step agreed written on every rank
        self._written: str | None = None
        self.monitor = ModelMonitor(engine, topology, cfg.stability.monitor_interval)
        self.attention_logits = AttentionLogitWarning(cfg.stability, self.anomalies)
        self.fp8_health = Fp8HealthWarning(cfg.stability, self.anomalies, cfg.model.fp8)
        if self.is_pipeline:
            # train_batch leaves no gap between the last backward and the step
            self.monitor.attach(engine)
        self.experts = ExpertHealth(cfg, engine.module, topology, self.anomalies)
        self.syncs = SyncCounter(cfg.logging.sync_debug, engine.device, run_dir, topology.rank)
        self._local_loss: float | None = None

    # -- one optimizer step, straight down ------------------------------------------------------------------------
    def train_step(self, state: TrainState) -> tuple[dict, Decision]:
        """Fetch → forward/backward → the guards' one agreed decision, applied by the engine → the step's record.

        Returns the metrics record and the decision the loop acts on (skip: already applied; rollback, stop)."""
        batch = self._fetch(state)
        lr = self.engine.get_lr()[
            0
        ]  # the LR this step uses (the scheduler advances inside the step)
        self.monitor.arm(batch.step)
        # DeepSpeed calls `_decide` after the gradients are reduced and before it updates (step_gate.py)
        with self.gate.deciding(lambda: self._decide(batch)):
            loss = self._forward_backward(batch)
        self.loss_fn.scale = 1.0
        # seals this rank's state before anything else can touch it
        self.guards.after_update(batch.step)
        self.faults.after_step(batch.step)
        applied = self.engine.was_step_applied()
        decision = self.gate.decision
        # DeepSpeed dropped the step before asking (non-finite, fp16)
        if not applied and not self.gate.consulted:
            stats = self._stats(batch)
            decision = self.gate.unconsulted(
                self._agreed(batch, self.guards.engine_skipped(stats, self.engine.fp16_enabled()))
            )
            # NaN unless fp16 (where the loss scaler's overflow is routine)
            batch.grad_norm = stats.grad_norm
        self._written = batch.saving if batch.saving and not batch.agreed.writing else None
        if batch.agreed.snapshots_settled:  # every rank's newest in-memory snapshot is whole
            self.checkpoints.settle_snapshots()
        # some rank's batch held a bad id: every rank names it, the same way
        if decision.sample is not None:
            decision = named_stop(decision, self.train_samples, self.order, batch.step)
            self.anomalies.record(
                "bad_token_id", batch.step, reason=decision.reason, sample=decision.sample
            )
        state.step, state.consumed_samples = batch.step, batch.end
        state.skipped_steps += int(not applied)
        if not applied and self.guards.nonfinite_at(batch.step):
            decision = self._classify_nonfinite(batch) or decision
        record = {
            "loss": loss,
            "lr": lr,
            "grad_norm": batch.grad_norm,
            "skipped": not applied,
            "batch_size": batch.size,
            "loss_scale": loss_scale(self.engine),
            **self.monitor.after_step(batch.step),
            **self.experts.after_step(batch.step, applied=applied),
        }
        self.attention_logits.check(batch.step, record)
        self.fp8_health.check(batch.step, record)
        return record, decision

    def _fetch(self, state: TrainState) -> StepBatch:
        """This rank's micro-batches for the next step (skip ranges, batch-size ramp-up, injected faults); the
        step after it starts reading in the background (keel/training/prefetch.py)."""
        train, step, dp = self.cfg.train, state.step + 1, self.topology.dp_size
        start = skip_to(state.consumed_samples, self.skip_ranges)
        size = rampup_batch_size(state.step, train, dp)
        engine_size = size * engine_batch_copies(self.cfg)
        # batch-size ramp-up: DeepSpeed adjusts accumulation
        if engine_size != self.engine.train_batch_size():
            self.engine.set_train_batch_size(engine_size)
        self.experts.before_step(
            loss_scale(self.engine) or 1.0, self.engine.gradient_accumulation_steps()
        )
        micro_batches, bad_row = self.prefetcher.get_checked(start, size)
        self.prefetcher.prefetch(
            skip_to(start + size, self.skip_ranges), rampup_batch_size(step, train, dp)
        )
        self.faults.before_forward(step)
        self.loss_fn.scale = self.faults.loss_scale(start, size)
        micro_batches, stop = check_step_batch(
            self.faults.batches(step, micro_batches),
            bad_row,
            self.train_samples.vocab_size,
            start,
            size,
            train.micro_batch_size,
            self.topology.dp_rank,
            dp,
        )
        return StepBatch(step, start, size, micro_batches, data_stop=stop)

    def _forward_backward(self, batch: StepBatch) -> float:
        """Every micro-batch forward and backward, then the engine's step (where the gate decides)."""
        if self.is_pipeline:  # DeepSpeed's 1F1B schedule runs every micro-batch and the step
            pairs = iter([(mb[:, :-1], mb[:, 1:]) for mb in batch.micro_batches])
            mean = self.engine.train_batch(data_iter=pairs)  # dp-averaged, broadcast to all stages
            # DeepSpeed dropped the step before asking: `_decide` read nothing
            if not self.gate.consulted:
                batch.device_losses = (None, mean)
                self._post_agreement(batch)
                self._read_step_values(batch, None)
            return batch.loss
        losses = []
        for i, micro_batch in enumerate(batch.micro_batches):
            self.engine.set_gradient_accumulation_boundary(i == len(batch.micro_batches) - 1)
            # pinned on CUDA (prefetch.py): the copy overlaps; the pipeline engine moves its micro-batches itself
            micro_batch = micro_batch.to(self.engine.device, non_blocking=True)
            loss = self.engine(micro_batch[:, :-1], micro_batch[:, 1:])
            self.engine.backward(loss)
            losses.append(loss.detach().float())
        local = torch.stack(losses).mean()
        batch.device_losses = (local, _device_mean(local, self.dp_group))  # read back in `_decide`
        self._post_agreement(batch)  # read back with them
        self.monitor.before_step(batch.step)
        self.engine.step()
        # DeepSpeed dropped the step before asking: read them now
        if batch.device_losses is not None:
            self._read_step_values(batch, None)
        return batch.loss

    def _decide(self, batch: StepBatch) -> Agreed:
        """The guards' decision on this step's global loss and gradient norm (called inside the engine's step),
        with what the ranks agreed: the same on every rank."""
        if self.is_pipeline:
            batch.device_losses = self._pipeline_losses()
            self._post_agreement(batch)
        self._read_step_values(batch, self._grad_norm())
        return self._agreed(batch, self.guards.decide(self._stats(batch)))

    def _post_agreement(self, batch: StepBatch) -> None:
        """This rank's data stop, preemption signal and background-save state, agreed over the world's device
        channel beside the loss (step_gate.py): no control-channel collective in a step."""
        batch.saving, writing = self.checkpoints.writing()
        batch.device_agreement = post_agreement(
            batch.data_stop or Decision(),
            self.preemption.signalled(),
            writing,
            self.topology.device("world"),
            self.engine.device,
            self.checkpoints.snapshot_state(),
        )

    def _agreed(self, batch: StepBatch, decision: Decision) -> Agreed:
        """The guards' `decision` (alike on every rank: they decide on reduced values) with the agreed data stop
        and flags of the step."""
        agreed = batch.agreed
        stop = agreed.decision if agreed.decision.action != Action.STEP else None
        return replace(agreed, decision=with_data_stop(decision, stop))

    def _read_step_values(self, batch: StepBatch, norm: torch.Tensor | float | None) -> None:
        """The step's one host sync: this rank's loss, the data-parallel mean, the gradient norm and the step's
        agreement, read back together."""
        local, mean = batch.device_losses
        batch.device_losses = None
        (self._local_loss, batch.loss, norm), codes = _read_back(
            local, mean, norm, codes=batch.device_agreement
        )
        batch.device_agreement = None
        batch.agreed = decode(codes, batch.data_stop or Decision(), self.topology.rank)
        batch.grad_norm = host_grad_norm(norm)

    @staticmethod
    def _stats(batch: StepBatch) -> StepStats:
        return StepStats(
            batch.step,
            loss=batch.loss,
            grad_norm=batch.grad_norm,
            sample_range=(batch.start, batch.end),
        )

    def _grad_norm(self) -> torch.Tensor | float | None:
        """This step's global norm as its engine holds it (a device scalar, or None where none is computed)."""
        if self.clipper.active:
            return self.clipper.norm if self.clipper.max_norm > 0 else self.clipper.measure()
        return raw_grad_norm_before_update(self.engine)

    def _pipeline_losses(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The pipeline's last stage holds the summed micro-batch losses; every rank needs their mean over
        replicas (the guards decide on it). Two device all-reduces over groups that do not grow with the world:
        over the pipeline group, to which only its last stage adds its loss (every rank of a stage holds the
        same loss: tp ranks alike, sp ranks the full sequence's), then the data-parallel mean. Every other
        rank adds a zero on the same device (never a CPU tensor).
        Returns (this rank's loss, None off the last stage; the mean), both left on the device."""
        summed = pipeline_summed_loss(self.engine)
        local = torch.zeros((), device=self.engine.device)
        if summed is not None:
            local = summed.detach().float() / self.engine.gradient_accumulation_steps()
        mine = local.clone() if summed is not None else None
        stage_loss = comm.all_reduce(local, self.topology.device("pp"))
        return mine, _device_mean(stage_loss, self.dp_group)

    def _classify_nonfinite(self, batch: StepBatch) -> Decision | None:
        """The skipped non-finite step: bad data or a transient fault (skipped: None), or corrupt weights or
        optimizer state (guards/state.py: the rollback or stop that calls for). Every rank checks its own state;
        where localization runs, every rank also replays its batch to name the first bad module."""
        bad_state = self.corrupt_state.check_here()
        reason = "non-finite weights or optimizer state"
        if not self.cfg.stability.localize_nonfinite or self.is_pipeline:
            bad_ranks = self.corrupt_state.ranks_with_it(bad_state)
            return (
                self.corrupt_state.decide(batch.step, reason, ranks_with_corrupt_state=bad_ranks)
                if bad_ranks
                else None
            )
        samples = step_sample_indices(
            batch.start,
            batch.size,
            self.cfg.train.micro_batch_size,
            self.topology.dp_rank,
            self.topology.dp_size,
        )
        on_device = [mb.to(self.engine.device) for mb in batch.micro_batches]
        summary = localize_on_all_ranks(
            self.engine.module,
            on_device,
            samples,
            self._local_loss,
            self.topology.control("world"),
            self._val_batch(0),
            bad_state,
        )
        if self.engine.zero_optimization_stage() == 3:
            self.engine.empty_partition_cache()  # the replay leaves gathered parameters behind
        if summary["classification"] == STATE:  # the same summary on every rank: the same decision
            return self.corrupt_state.decide(batch.step, reason, **summary)
        self.anomalies.record("nonfinite", batch.step, phase="localized", **summary)
        data = summary["classification"] == "data"
        log.warning(
            "step %d: non-finite values localized: %s",
            batch.step,
            f"{summary.get('first_bad_module')} on rank {summary['bad_rank']} (data; samples recorded)"
            if data
            else f"transient on rank(s) {summary['bad_ranks']}",
        )
        return None

    def _val_batch(self, index: int) -> torch.Tensor:
        """This data-parallel rank's validation micro-batch `index`, on the device (fixed for the whole run)."""
        mbs, n = self.cfg.train.micro_batch_size, len(self.val_samples)
        first = (index * self.topology.dp_size + self.topology.dp_rank) * mbs
        rows = [torch.from_numpy(self.val_samples[(first + j) % n]) for j in range(mbs)]
        return torch.stack(rows).to(self.engine.device)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over `eval_batches` fixed validation micro-batches per data-parallel rank."""
        train = self.cfg.train
        batches = [self._val_batch(b) for b in range(train.eval_batches)]
        if self.is_pipeline:
            pairs = iter([(batch[:, :-1], batch[:, 1:]) for batch in batches])
            return self.engine.eval_batch(pairs, num_micro_batches=train.eval_batches).item()
        self.engine.eval()
        total = sum(self.engine(batch[:, :-1], batch[:, 1:]).float() for batch in batches)
        self.engine.train()
        return _device_mean(total / train.eval_batches, self.dp_group).item()

    # -- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        train, stability = self.cfg.train, self.cfg.stability
        with self.startup.phase("restore"):
            state = self.checkpoints.resume()
        metrics = MetricsWriter(
            self.run_dir,
            self.topology.rank == 0,
            state.step,
            self.cfg.logging.log_interval,
            train.steps,
            run_progress(self.cfg, self.topology.shape.world_size, self.engine.device)
            if self.topology.rank == 0
            else None,
        )
        self.sinks = Sinks(
            self.run_dir,
            stability,
            self.cfg.to_dict(),
            enabled=self.topology.rank == 0,
            resumed_step=state.step,
        )
        watchdog = Watchdog(
            self.run_dir, self.topology.rank, stability.watchdog_timeout, self.anomalies
        )
        stragglers = StragglerMonitor(
            self.topology.control("world"),
            stability.straggler_interval,
            stability.straggler_bad_spread,
        )
        try:
            # leaving the block within a hang's deadline counts as that hang (see watchdog.py)
            with watchdog:
                result = self._loop(state, metrics, watchdog, stragglers)
                self._record_startup(
                    result.state.step, time.time(), 0.0
                )  # no step was left to train
                # the last save completes
                with watchdog.phase("checkpoint save", stability.watchdog_save_timeout):
                    stop = self.checkpoints.background(wait=True, final=True)
                    self.checkpoints.finish(
                        result.finished and not result.exit_code and stop.action != Action.STOP
                    )
                if stop.action != Action.STOP or result.exit_code:
                    return result
                log.error("stopping at step %d: %s", result.state.step, stop.reason)
                return TrainResult(
                    result.state, finished=False, exit_code=stop.exit_code, reason=stop.reason
                )
        finally:
            self.prefetcher.close()
            self.syncs.report()
            metrics.close()
            self.sinks.close()

    def _loop(
        self,
        state: TrainState,
        metrics: MetricsWriter,
        watchdog: Watchdog,
        stragglers: StragglerMonitor,
    ) -> TrainResult:
        train, checkpoint, stability = self.cfg.train, self.cfg.checkpoint, self.cfg.stability
        steps_here, save_time = 0, None
        while state.step < train.steps:
            watchdog.beat(state.step + 1)
            start, started_at = time.perf_counter(), time.time()
            with self.syncs.step():
                record, decision = self.train_step(state)
            steps_here += 1
            record = self._timed(record, state, time.perf_counter() - start, stragglers)
            if steps_here == 1:  # start-up ends with the first step
                self._record_startup(state.step, started_at, record["step_time_s"])
            # the save after the previous step: its cost, next to the step's own
            if save_time is not None:
                record["save_time_s"], save_time = save_time, None
            # periodic checks and evaluation: collectives of their own, each phase with its own deadline
            with (
                watchdog.phase("checks", stability.watchdog_check_timeout),
                _clock(record, "check_time_s"),
            ):
                checks = self.guards.after_step(state.step, record["loss_scale"], self._local_loss)
                saved = self.checkpoints.background(written=self._written)
                decision = Decision.most_severe([decision, checks, saved])
            if train.eval_interval and (
                state.step % train.eval_interval == 0 or state.step == train.steps
            ):
                with (
                    watchdog.phase("evaluation", stability.watchdog_eval_timeout),
                    _clock(record, "eval_time_s"),
                ):
                    record["val_loss"] = self.evaluate()
            metrics.log(record)
            self.sinks.log(state.step, record)
            stop_early = (
                train.exit_after and steps_here >= train.exit_after and state.step < train.steps
            )
            preempted = self.gate.preempted and state.step < train.steps
            ending = state.step == train.steps or stop_early or preempted
            periodic = checkpoint.interval and state.step % checkpoint.interval == 0
            if decision.action < Action.ROLLBACK and (ending or periodic):
                with watchdog.phase("checkpoint save", stability.watchdog_save_timeout):
                    save_time, after_save = self.checkpoints.save(state, ending)
                decision = Decision.most_severe([decision, after_save])
            if decision.action < Action.ROLLBACK and not ending:
                with watchdog.phase("checkpoint save", stability.watchdog_save_timeout):
                    stall = self.checkpoints.snapshot(state)
                if stall:
                    save_time = (save_time or 0.0) + stall
            if decision.action in (Action.STOP, Action.ROLLBACK):
                outcome = self._act(decision, state, metrics, watchdog)
                if isinstance(outcome, TrainResult):
                    return outcome
                state = outcome
                continue
            if preempted:
                self.anomalies.record("preempted", state.step, signal=self.preemption.received)
                return TrainResult(
                    state, finished=False, exit_code=ExitCode.PREEMPTED, reason="preempted"
                )
            if stop_early:
                return TrainResult(state, finished=False)
        return TrainResult(state, finished=True)

    def _record_startup(self, step: int, started_at: float, seconds: float) -> None:
        """Rank 0: this launch's start-up into the run's timeline, once (a launch with no step left to train
        records it at its end, its start-up lost all the same)."""
        if self.topology.rank == 0 and not self._startup_recorded:
            timeline.append(self.run_dir, self.startup.record(step, started_at, seconds))
        self._startup_recorded = True

    def _act(
        self, decision: Decision, state: TrainState, metrics: MetricsWriter, watchdog: Watchdog
    ) -> TrainResult | TrainState:
        """A STOP ends the run (the result to return); a ROLLBACK returns the state rolled back to."""
        if decision.action == Action.STOP:
            log.error("stopping at step %d: %s", state.step, decision.reason)
            return TrainResult(
                state, finished=False, exit_code=decision.exit_code, reason=decision.reason
            )
        first = (self.guards.last_event or {}).get("first_spike_step", state.step)
        factor = 1.0 if decision.restore else self.cfg.stability.rollback_lr_factor
        with watchdog.phase("rollback", self.cfg.stability.watchdog_save_timeout):
            # a pending background save concludes first (published or discarded): its failure may stop the run
            pending = self.checkpoints.background(wait=True)
            if pending.action == Action.STOP:
                log.error("stopping at step %d: %s", state.step, pending.reason)
                return TrainResult(
                    state, finished=False, exit_code=pending.exit_code, reason=pending.reason
                )
            return self.checkpoints.rollback(
                state,
                lambda step: (metrics.rewind(step, "rollback"), self.sinks.rewind(step)),
                first,
                decision.reason,
                factor,
                decision.to,
                decision.rewind_data,
            )

    def _timed(
        self, record: dict, state: TrainState, elapsed: float, stragglers: StragglerMonitor
    ) -> dict:
        """The step's record with its position, throughput and (every straggler interval) the slowest rank."""
        seq_len = self.cfg.data.seq_len
        record = {
            "step": state.step,
            **record,
            "tokens": state.consumed_samples * seq_len,
            "tokens_per_s": record["batch_size"] * seq_len / elapsed,
            "step_time_s": elapsed,
            "time": time.time(),  # the step's end, wall clock: goodput's timeline
            "consumed_samples": state.consumed_samples,
            "lr_scale": state.lr_scale,
        }
        # the allocator's own counter: no device sync
        if torch.device(self.engine.device).type == "cuda":
            record["gpu_mem_peak_gib"] = torch.cuda.max_memory_allocated(self.engine.device) / 2**30
        # this process's peak resident memory (Linux counts KiB): what the kernel's OOM killer weighs
        record["host_mem_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        # of it, now: code and mapped files, which the kernel can reclaim
        file_backed = timeline.resident_gib("RssFile")
        if file_backed is not None:
            record["host_mem_file_gib"] = file_backed
        report = stragglers.update(state.step, elapsed)
        if report is not None:
            record.update(report.metrics)
            if self.topology.rank == 0:
                log.info(report.line)
                repeats = self.cfg.stability.straggler_bad_repeats
                if repeats and report.streak == repeats:
                    self._record_straggler(state.step, report)
        return record

    def _record_straggler(self, step: int, report: StragglerReport) -> None:
        """The node slowest at `straggler_bad_repeats` checks in a row into bad_nodes.json (rank 0)."""
        node = record_bad_node(
            self.run_dir,
            report.host,
            "straggler",
            step,
            checks=report.streak,
            interval=self.cfg.stability.straggler_interval,
            **report.metrics,
        )
        if node is not None:
            log.warning(
                "step %d: node %s recorded as bad: its rank was the slowest at %d straggler checks in a row",
                step,
                node.host,
                report.streak,
            )
