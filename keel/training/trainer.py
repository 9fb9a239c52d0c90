"""The training loop: batch → forward/backward per micro-batch → optimizer step → metrics → checkpoint.

The data position is the global number of consumed samples, so the loop is the same at any data-parallel size
and a resume continues with exactly the samples an uninterrupted run would have used.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from keel.config import RunConfig
from keel.data import GlobalSampleOrder, PackedSamples, step_batch
from keel.parallel.grad_norm import global_grad_norm
from keel.parallel.topology import Topology
from keel.training.checkpoint import Checkpointer, TrainState
from keel.training.metrics import MetricsWriter

log = logging.getLogger("keel")


@dataclass
class TrainResult:
    state: TrainState
    finished: bool  # reached train.steps (False: stopped early by train.exit_after)


def _mean_over(value: torch.Tensor, group) -> float:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        value = value.clone()
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return value.item()


def grad_norm(engine) -> float | None:
    """The global gradient norm of the step just taken (DeepSpeed reports it except for plain fp32 ZeRO-0)."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm)


def loss_scale(engine) -> float | None:
    """fp16's current dynamic loss scale (after this step's update); None in fp32/bf16."""
    if not engine.fp16_enabled():
        return None
    optimizer = engine.optimizer
    config = getattr(optimizer, "loss_scale_config", None)
    return float(config.cur_scale if config is not None else optimizer.cur_scale)


class Trainer:
    def __init__(self, cfg: RunConfig, engine, topology: Topology, train_samples: PackedSamples,
                 val_samples: PackedSamples, run_dir: Path):
        self.cfg = cfg
        self.engine = engine
        self.topology = topology
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.order = GlobalSampleOrder(len(train_samples), cfg.train.seed)
        self.checkpointer = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep_last, topology)
        self.run_dir = run_dir
        self.dp_group = topology.group("dp")
        self.needs_own_grad_norm = (
            engine.zero_optimization_stage() == 0 and not engine.fp16_enabled() and not engine.bfloat16_enabled()
        )

    # -- one optimizer step --------------------------------------------------------------------------------
    def train_step(self, state: TrainState) -> dict:
        t = self.cfg.train
        micro_batches = step_batch(self.order, self.train_samples, state.consumed_samples, t.global_batch_size,
                                   t.micro_batch_size, self.topology.dp_rank, self.topology.dp_size)
        losses = []
        norm = None
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            self.engine.set_gradient_accumulation_boundary(last)
            loss = self.engine(batch[:, :-1], batch[:, 1:])
            self.engine.backward(loss)
            losses.append(loss.detach().float())
        if self.needs_own_grad_norm:
            norm = global_grad_norm(self.engine.module.parameters(), self.topology)
        lr = self.engine.get_lr()[0]  # the LR this step uses (the scheduler advances inside step())
        self.engine.step()
        if norm is None:
            norm = grad_norm(self.engine)
        loss = _mean_over(torch.stack(losses).mean(), self.dp_group)
        return {"loss": loss, "lr": lr, "grad_norm": norm, "skipped": not self.engine.was_step_applied(),
                "loss_scale": loss_scale(self.engine)}

    @torch.no_grad()
    def evaluate(self) -> float:
        t = self.cfg.train
        self.engine.eval()
        total = torch.zeros(())
        n = len(self.val_samples)
        for b in range(t.eval_batches):
            first = (b * self.topology.dp_size + self.topology.dp_rank) * t.micro_batch_size
            rows = [torch.from_numpy(self.val_samples[(first + j) % n]) for j in range(t.micro_batch_size)]
            batch = torch.stack(rows)
            total += self.engine(batch[:, :-1], batch[:, 1:]).float()
        self.engine.train()
        return _mean_over(total / t.eval_batches, self.dp_group)

    # -- the loop -------------------------------------------------------------------------------------------
    def resume(self) -> TrainState:
        if not self.cfg.checkpoint.resume:
            return TrainState()
        tag = self.checkpointer.latest_tag()
        if tag is None:
            return TrainState()
        state = self.checkpointer.load(self.engine, tag, self.cfg.train.seed)
        if self.topology.rank == 0:
            log.info("resumed from %s: step %d, %d samples consumed", tag, state.step, state.consumed_samples)
        return state

    def fit(self) -> TrainResult:
        t, c = self.cfg.train, self.cfg.checkpoint
        state = self.resume()
        metrics = MetricsWriter(self.run_dir, self.topology.rank == 0, state.step, self.cfg.logging.log_interval,
                                t.steps)
        tokens_per_step = t.global_batch_size * self.cfg.data.seq_len
        steps_here = 0
        try:
            while state.step < t.steps:
                start = time.perf_counter()
                record = self.train_step(state)
                state.step += 1
                state.consumed_samples += t.global_batch_size
                steps_here += 1
                elapsed = time.perf_counter() - start
                record = {"step": state.step, **record, "tokens": state.consumed_samples * self.cfg.data.seq_len,
                          "tokens_per_s": tokens_per_step / elapsed, "step_time_s": elapsed,
                          "consumed_samples": state.consumed_samples}
                if t.eval_interval and (state.step % t.eval_interval == 0 or state.step == t.steps):
                    record["val_loss"] = self.evaluate()
                metrics.log(record)
                stop_early = t.exit_after and steps_here >= t.exit_after and state.step < t.steps
                if state.step == t.steps or stop_early or (c.interval and state.step % c.interval == 0):
                    self.checkpointer.save(self.engine, state)
                if stop_early:
                    return TrainResult(state, finished=False)
        finally:
            metrics.close()
        return TrainResult(state, finished=True)
