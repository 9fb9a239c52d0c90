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
from keel.parallel.grad_norm import clip_grad_norm_
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
        self.is_pipeline = cfg.parallel.pp > 1
        self._own_grad_norm: float | None = None
        if engine.zero_optimization_stage() == 0 and not engine.fp16_enabled() and not engine.bfloat16_enabled():
            self._take_over_fp32_clipping()

    def _take_over_fp32_clipping(self) -> None:
        """Plain fp32 ZeRO-0: clip (and record) by Keel's model-parallel-aware norm, just before the step."""
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        max_norm = self.engine.gradient_clipping()

        def clip(*_args, **_kwargs) -> None:
            self._own_grad_norm = clip_grad_norm_(params, max_norm, self.topology)

        if max_norm > 0:
            self.engine.clip_fp32_gradients = clip  # DeepSpeed calls this right before optimizer.step()
        else:
            self.engine.optimizer.register_step_pre_hook(clip)

    # -- one optimizer step --------------------------------------------------------------------------------
    def train_step(self, state: TrainState) -> dict:
        t = self.cfg.train
        micro_batches = step_batch(self.order, self.train_samples, state.consumed_samples, t.global_batch_size,
                                   t.micro_batch_size, self.topology.dp_rank, self.topology.dp_size)
        lr = self.engine.get_lr()[0]  # the LR this step uses (the scheduler advances inside the step)
        self._own_grad_norm = None
        if self.is_pipeline:  # DeepSpeed's 1F1B schedule runs every micro-batch and the step
            pairs = iter([(batch[:, :-1], batch[:, 1:]) for batch in micro_batches])
            loss = self.engine.train_batch(data_iter=pairs).item()  # dp-averaged, broadcast to all stages
        else:
            losses = []
            for i, batch in enumerate(micro_batches):
                self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
                loss = self.engine(batch[:, :-1], batch[:, 1:])
                self.engine.backward(loss)
                losses.append(loss.detach().float())
            self.engine.step()
            loss = _mean_over(torch.stack(losses).mean(), self.dp_group)
        norm = self._own_grad_norm if self._own_grad_norm is not None else grad_norm(self.engine)
        return {"loss": loss, "lr": lr, "grad_norm": norm, "skipped": not self.engine.was_step_applied(),
                "loss_scale": loss_scale(self.engine)}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over `eval_batches` fixed validation micro-batches per data-parallel rank."""
        t = self.cfg.train
        n = len(self.val_samples)
        batches = []
        for b in range(t.eval_batches):
            first = (b * self.topology.dp_size + self.topology.dp_rank) * t.micro_batch_size
            rows = [torch.from_numpy(self.val_samples[(first + j) % n]) for j in range(t.micro_batch_size)]
            batches.append(torch.stack(rows))
        if self.is_pipeline:
            pairs = iter([(batch[:, :-1], batch[:, 1:]) for batch in batches])
            return self.engine.eval_batch(pairs, num_micro_batches=t.eval_batches).item()
        self.engine.eval()
        total = sum(self.engine(batch[:, :-1], batch[:, 1:]).float() for batch in batches)
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
