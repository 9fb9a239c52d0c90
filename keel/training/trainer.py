"""The training loop: batch → forward/backward per micro-batch → guarded optimizer step → metrics → checkpoint.

The data position is the global number of consumed samples, so the loop is the same at any data-parallel size
and a resume continues with exactly the samples an uninterrupted run would have used. Guards decide inside the
optimizer step (keel/training/guards/); this loop acts on their decisions: skip, roll back, or stop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from keel.config import RunConfig
from keel.data import GlobalSampleOrder, PackedSamples, step_batch, step_sample_indices
from keel.parallel.topology import Topology
from keel.training.checkpoint import Checkpointer, TrainState
from keel.training.engine import Fp32GradClipper, LRScale
from keel.training.expert_health import ExpertHealth
from keel.training.faults import FaultInjector
from keel.training.guards.base import Action, AnomalyLog, Decision, StepStats
from keel.training.guards.gate import reported_grad_norm
from keel.training.guards.localize import localize
from keel.training.guards.stack import GuardStack
from keel.training.lr_schedule import rampup_batch_size
from keel.training.metrics import MetricsWriter
from keel.training.monitor import ModelMonitor, Sinks
from keel.training.preemption import EXIT_PREEMPTED, PreemptionHandler
from keel.training.watchdog import StragglerMonitor, Watchdog

log = logging.getLogger("keel")


@dataclass
class TrainResult:
    state: TrainState
    finished: bool  # reached train.steps (False: stopped early by train.exit_after or a guard)
    exit_code: int = 0
    reason: str = ""


def _mean_over(value: torch.Tensor, group) -> float:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        value = value.clone()
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return value.item()


def loss_scale(engine) -> float | None:
    """fp16's current dynamic loss scale (after this step's update); None in fp32/bf16."""
    if not engine.fp16_enabled():
        return None
    optimizer = engine.optimizer
    config = getattr(optimizer, "loss_scale_config", None)
    return float(config.cur_scale if config is not None else optimizer.cur_scale)


def parse_skip_ranges(ranges: list[str]) -> list[tuple[int, int]]:
    spans = []
    for item in ranges:
        start, end = (int(x) for x in str(item).split(":"))
        spans.append((start, end))
    return sorted(spans)


class Trainer:
    def __init__(self, cfg: RunConfig, engine, topology: Topology, train_samples: PackedSamples,
                 val_samples: PackedSamples, run_dir: Path, lr_scale: LRScale | None = None):
        self.cfg = cfg
        self.engine = engine
        self.topology = topology
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.order = GlobalSampleOrder(len(train_samples), cfg.train.seed)
        self.checkpointer = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep_last, topology)
        self.run_dir = run_dir
        self.dp_group = topology.group("dp")
        self.is_pipeline = cfg.parallel.pp > 1
        self.lr_scale = lr_scale or LRScale()
        self.clipper = Fp32GradClipper(engine, topology)
        self.skip_ranges = parse_skip_ranges(cfg.data.skip_ranges)
        self.anomalies = AnomalyLog(run_dir, topology.rank)
        self.faults = FaultInjector(cfg.faults, topology.rank, engine.module, cfg.model.vocab_size, cfg.train.seed)
        self.loss_fn = engine.module.loss_fn
        self.guards = GuardStack(cfg, engine, topology, self.anomalies, self._step_stats)
        self.monitor = ModelMonitor(engine, topology, cfg.stability.monitor_interval)
        if self.is_pipeline:
            self.monitor.attach(engine)  # train_batch leaves no gap between the last backward and the step
        self.experts = ExpertHealth(cfg, engine.module, topology, self.anomalies)
        self.preemption = PreemptionHandler()
        self._pending: StepStats | None = None
        self._local_loss: float | None = None

    # -- what the guards see ------------------------------------------------------------------------------------
    def _step_stats(self) -> StepStats:
        """Called inside the optimizer step: the step's global loss and gradient norm."""
        stats = self._pending
        if self.is_pipeline:
            stats.loss = self._pipeline_loss()
        stats.grad_norm = self._grad_norm()
        return stats

    def _grad_norm(self) -> float | None:
        if self.clipper.active:
            return self.clipper.norm if self.clipper.max_norm > 0 else self.clipper.measure()
        return reported_grad_norm(self.engine)

    def _pipeline_loss(self) -> float:
        """The pipeline's last stage holds the summed micro-batch losses; average them over replicas."""
        engine = self.engine
        local = torch.zeros(())
        if engine.is_last_stage() and self.topology.rank_in("tp") == 0:
            local = engine.total_loss.detach().float() / engine.gradient_accumulation_steps()
        dist.all_reduce(local)
        self._local_loss = float(local) if engine.is_last_stage() else None
        return float(local) / self.topology.dp_size

    # -- one optimizer step --------------------------------------------------------------------------------
    def _data_cursor(self, consumed: int) -> int:
        for start, end in self.skip_ranges:  # data.skip_ranges: jump over known-bad samples
            if start <= consumed < end:
                consumed = end
        return consumed

    def train_step(self, state: TrainState) -> dict:
        t = self.cfg.train
        step = state.step + 1
        consumed = self._data_cursor(state.consumed_samples)
        batch_size = rampup_batch_size(state.step, t, self.topology.dp_size)
        if batch_size != self.engine.train_batch_size():  # batch-size ramp-up: DeepSpeed adjusts accumulation
            self.engine.set_train_batch_size(batch_size)
        self.experts.before_step(loss_scale(self.engine) or 1.0, self.engine.gradient_accumulation_steps())
        micro_batches = step_batch(self.order, self.train_samples, consumed, batch_size,
                                   t.micro_batch_size, self.topology.dp_rank, self.topology.dp_size)
        micro_batches = self.faults.batches(step, micro_batches)
        self.faults.before_forward(step)
        self.loss_fn.scale = self.faults.loss_scale(consumed, batch_size)
        lr = self.engine.get_lr()[0]  # the LR this step uses (the scheduler advances inside the step)
        self._pending = StepStats(step, loss=float("nan"), grad_norm=None,
                                  sample_range=(consumed, consumed + batch_size))
        self.guards.new_step()
        self.monitor.arm(step)
        if self.is_pipeline:  # DeepSpeed's 1F1B schedule runs every micro-batch and the step
            pairs = iter([(batch[:, :-1], batch[:, 1:]) for batch in micro_batches])
            loss = self.engine.train_batch(data_iter=pairs).item()  # dp-averaged, broadcast to all stages
        else:
            losses = []
            for i, batch in enumerate(micro_batches):
                self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
                batch = batch.to(self.engine.device)  # the pipeline engine moves its micro-batches itself
                loss = self.engine(batch[:, :-1], batch[:, 1:])
                self.engine.backward(loss)
                losses.append(loss.detach().float())
            local = torch.stack(losses).mean()
            self._local_loss = local.item()
            loss = self._pending.loss = _mean_over(local, self.dp_group)
            self.monitor.before_step(step)
            self.engine.step()
        self.loss_fn.scale = 1.0
        self.faults.after_step(step)
        state.step, state.consumed_samples = step, consumed + batch_size
        skipped = not self.engine.was_step_applied()
        if skipped:
            self.guards.engine_skipped(self.engine.fp16_enabled())
        state.skipped_steps += int(skipped)
        last = self.guards.last_event
        if skipped and last is not None and last["kind"] == "nonfinite" and last["step"] == step:
            self._localize(step, micro_batches, consumed)
        return {"loss": loss, "lr": lr, "grad_norm": self._pending.grad_norm, "skipped": skipped,
                "batch_size": batch_size, "loss_scale": loss_scale(self.engine), **self.monitor.after_step(step),
                **self.experts.after_step(step, applied=not skipped)}

    def _localize(self, step: int, micro_batches: list[torch.Tensor], consumed: int) -> None:
        """Replay the skipped batch on every rank to name the first bad module and classify the cause."""
        if not self.cfg.stability.localize_nonfinite or self.is_pipeline:
            return
        t = self.cfg.train
        samples = step_sample_indices(consumed, sum(len(b) for b in micro_batches) * self.topology.dp_size,
                                      t.micro_batch_size, self.topology.dp_rank, self.topology.dp_size)
        on_device = [batch.to(self.engine.device) for batch in micro_batches]
        event = localize(self.engine.module, on_device, samples).event()
        if self.engine.zero_optimization_stage() == 3:
            self.engine.empty_partition_cache()  # the replay leaves gathered parameters behind
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, {**event, "local_loss": self._local_loss})
        data = [(rank, e) for rank, e in enumerate(found) if e["classification"] == "data"]
        if data:
            rank, event = data[0]
            summary = {**event, "classification": "data", "bad_rank": rank}
        else:
            flaky = [rank for rank, e in enumerate(found)
                     if e["replays_nonfinite"] or not torch.isfinite(torch.tensor(e["local_loss"] or 0.0))]
            summary = {"classification": "transient", "bad_ranks": flaky,
                       "hosts": [found[r].get("host") for r in flaky]}
        self.anomalies.record("nonfinite", step, phase="localized", **summary)
        log.warning("step %d: non-finite values localized: %s", step,
                    f"{summary.get('first_bad_module')} on rank {summary['bad_rank']} (data; samples recorded)"
                    if data else f"transient on rank(s) {summary['bad_ranks']}")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over `eval_batches` fixed validation micro-batches per data-parallel rank."""
        t = self.cfg.train
        n = len(self.val_samples)
        batches = []
        for b in range(t.eval_batches):
            first = (b * self.topology.dp_size + self.topology.dp_rank) * t.micro_batch_size
            rows = [torch.from_numpy(self.val_samples[(first + j) % n]) for j in range(t.micro_batch_size)]
            batches.append(torch.stack(rows).to(self.engine.device))
        if self.is_pipeline:
            pairs = iter([(batch[:, :-1], batch[:, 1:]) for batch in batches])
            return self.engine.eval_batch(pairs, num_micro_batches=t.eval_batches).item()
        self.engine.eval()
        total = sum(self.engine(batch[:, :-1], batch[:, 1:]).float() for batch in batches)
        self.engine.train()
        return _mean_over(total / t.eval_batches, self.dp_group)

    # -- acting on decisions --------------------------------------------------------------------------------
    def rollback(self, state: TrainState, metrics: MetricsWriter, first_bad_step: int, reason: str,
                 lr_factor: float) -> TrainState:
        """Reload the last checkpoint written before `first_bad_step`, scale the LR, keep the data cursor."""
        tag = self.checkpointer.tag_at_or_before(first_bad_step - 1)
        if tag is None:
            self.anomalies.record("rollback", state.step, done=False, reason=f"{reason}; no checkpoint to return to")
            log.warning("step %d: %s, but no checkpoint precedes step %d: continuing", state.step, reason,
                        first_bad_step)
            return state
        cursor, scale, rollbacks = state.consumed_samples, state.lr_scale * lr_factor, state.rollbacks
        restored = self.checkpointer.load(self.engine, tag, self.cfg.train.seed)
        restored.consumed_samples, restored.lr_scale, restored.rollbacks = cursor, scale, rollbacks + 1
        self.lr_scale.value = scale
        sync_lr(self.engine.lr_scheduler)
        metrics.rewind(restored.step)
        self.sinks.rewind(restored.step)
        self.anomalies.record("rollback", state.step, done=True, reason=reason, to_step=restored.step,
                              checkpoint=tag, lr_scale=scale, data_cursor=cursor)
        log.warning("step %d: %s — rolled back to %s, LR × %.3g, data continues at sample %d", state.step, reason,
                    tag, scale, cursor)
        return restored

    # -- the loop -------------------------------------------------------------------------------------------
    def resume(self) -> TrainState:
        if not self.cfg.checkpoint.resume:
            return TrainState()
        tag = self.checkpointer.latest_tag()
        if tag is None:
            return TrainState()
        state = self.checkpointer.load(self.engine, tag, self.cfg.train.seed)
        self.guards.load_state_dict(self.checkpointer.read_manifest(tag).get("guards", {}))
        self.lr_scale.value = state.lr_scale
        sync_lr(self.engine.lr_scheduler)
        if self.topology.rank == 0:
            log.info("resumed from %s: step %d, %d samples consumed", tag, state.step, state.consumed_samples)
        return state

    def save(self, state: TrainState) -> None:
        self.checkpointer.save(self.engine, state, guards=self.guards.state_dict())

    def fit(self) -> TrainResult:
        t, s = self.cfg.train, self.cfg.stability
        state = self.resume()
        metrics = MetricsWriter(self.run_dir, self.topology.rank == 0, state.step, self.cfg.logging.log_interval,
                                t.steps)
        self.sinks = Sinks(self.run_dir, s, self.cfg.to_dict(), enabled=self.topology.rank == 0,
                           resumed_step=state.step)
        watchdog = Watchdog(self.run_dir, self.topology.rank, s.watchdog_timeout, self.anomalies)
        stragglers = StragglerMonitor(self.topology, s.straggler_interval)
        try:
            with watchdog:  # leaving the block within a hang's deadline counts as that hang (see watchdog.py)
                return self._loop(state, metrics, watchdog, stragglers)
        finally:
            metrics.close()
            self.sinks.close()

    def _loop(self, state: TrainState, metrics: MetricsWriter, watchdog: Watchdog,
              stragglers: StragglerMonitor) -> TrainResult:
        t, c = self.cfg.train, self.cfg.checkpoint
        steps_here = 0
        while state.step < t.steps:
            watchdog.beat(state.step + 1)
            start = time.perf_counter()
            record = self.train_step(state)
            steps_here += 1
            elapsed = time.perf_counter() - start
            record = {"step": state.step, **record, "tokens": state.consumed_samples * self.cfg.data.seq_len,
                      "tokens_per_s": record["batch_size"] * self.cfg.data.seq_len / elapsed, "step_time_s": elapsed,
                      "consumed_samples": state.consumed_samples, "lr_scale": state.lr_scale}
            report = stragglers.update(state.step, elapsed)
            if report is not None:
                record.update(report.metrics)
                if self.topology.rank == 0:
                    log.info(report.line)
            with watchdog.paused():  # collectives of their own; a hang here is not the step's
                decision = Decision.most_severe([
                    self.guards.decision,
                    self.guards.after_step(state.step, record["loss_scale"], self._local_loss)])
                if t.eval_interval and (state.step % t.eval_interval == 0 or state.step == t.steps):
                    record["val_loss"] = self.evaluate()
            metrics.log(record)
            self.sinks.log(state.step, record)
            if decision.action == Action.STOP:
                log.error("stopping at step %d: %s", state.step, decision.reason)
                return TrainResult(state, finished=False, exit_code=decision.exit_code, reason=decision.reason)
            if decision.action == Action.ROLLBACK:
                first = (self.guards.last_event or {}).get("first_spike_step", state.step)
                factor = 1.0 if decision.restore else self.cfg.stability.rollback_lr_factor
                with watchdog.paused():
                    state = self.rollback(state, metrics, first, decision.reason, factor)
                continue
            stop_early = t.exit_after and steps_here >= t.exit_after and state.step < t.steps
            preempted = self.preemption.should_stop() and state.step < t.steps
            if state.step == t.steps or stop_early or preempted or (c.interval and state.step % c.interval == 0):
                with watchdog.paused():
                    self.save(state)
            if preempted:
                self.anomalies.record("preempted", state.step, signal=self.preemption.received)
                return TrainResult(state, finished=False, exit_code=EXIT_PREEMPTED, reason="preempted")
            if stop_early:
                return TrainResult(state, finished=False)
        return TrainResult(state, finished=True)


def sync_lr(scheduler) -> None:
    """Put the schedule's LR for its current position into the optimizer (after a load or an LR rescale)."""
    if scheduler is None:
        return
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
