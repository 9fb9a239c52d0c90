"""Training monitoring: where in the model a run is going wrong, and the dashboards that show it.

A loss curve says *that* a run is in trouble; per-layer gradient norms, the update/parameter ratio and per-block
activation statistics say *where* (an embedding whose updates outgrow its weights, one block's activations
blowing up). `ModelMonitor` measures them every `interval` steps and returns flat scalars that go into the
metrics record, so metrics.jsonl and the dashboards carry the same numbers. `Sinks` sends every record to
TensorBoard and/or Weights & Biases.

Ordinary steps cost nothing: no hooks are registered, no parameter is copied and nothing is reduced unless
the step is a monitor step (`step % interval == 0`).
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from keel.adapters.deepspeed_internals import (
    is_pipe_replicated,
    loss_scale,
    pipeline_local_specs,
    wrap_model_step,
)
from keel.config import ConfigError, StabilityConfig
from keel.data.atomic import write_atomic
from keel.model import Block
from keel.parallel import comm
from keel.parallel.pipeline import local_layers
from keel.parallel.topology import Topology

# -- sinks ------------------------------------------------------------------------------------------------------
# Metrics-record keys whose dashboard tag is not simply `train/<key>`; keys holding a "/" are tags already.
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "tokens_per_s": "train/tokens_per_s",
    "skipped": "train/skipped",
    "val_loss": "val/loss",
}
NOT_LOGGED = ("step",)  # the x axis, not a series


def tag_for(key: str) -> str:
    return TAGS.get(key, key if "/" in key else f"train/{key}")


def dashboard_scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Tag → value for every finite number in `record`; nested dicts become paths (guards={"spike": 2} →
    guards/spike). None, strings and non-finite values are left out: a dashboard plots numbers only."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(dashboard_scalars(value, prefix=f"{name}/"))
        elif key not in NOT_LOGGED and isinstance(value, numbers.Real) and math.isfinite(value):
            out[tag_for(name)] = float(value)
    return out


def check_sinks(stability: StabilityConfig) -> None:
    """Raise a one-line ConfigError if a configured sink's package is missing.

    Called by `Sinks` on every rank (not only the one that writes), so all ranks stop together at start-up
    instead of rank 0 failing while the others wait in a collective; a launcher may call it before any rank starts.
    """
    if stability.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("stability.tensorboard: true but the tensorboard package is not installed; "
                          "pip install tensorboard, or set stability.tensorboard=false")
    if stability.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("stability.wandb: true but the wandb package is not installed; "
                          "pip install wandb, or set stability.wandb=false")


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id, kept in `<run_dir>/wandb_id.txt` so a restarted job continues its run, not a new one."""
    path = Path(run_dir) / "wandb_id.txt"
    if path.is_file():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:16]
    write_atomic(path, run_id.encode())
    return run_id


class Sinks:
    """TensorBoard (`<run_dir>/tensorboard/`) and W&B behind one `log(step, record)`; each optional.

    Only the rank given `enabled` writes. On resume, TensorBoard is told to drop the old events past
    `resumed_step` (those steps are trained again), as metrics.jsonl does. W&B cannot rewrite history: it keeps
    the first values and warns about (and drops) steps logged again below its last one.
    """

    def __init__(self, run_dir: str | Path, stability: StabilityConfig, run_config: dict[str, Any] | None = None,
                 enabled: bool = True, resumed_step: int = 0) -> None:
        check_sinks(stability)
        self._tensorboard = None
        self._wandb = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        if stability.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"),
                                              purge_step=resumed_step + 1 if resumed_step > 0 else None)
        if stability.wandb:
            import wandb

            self._wandb = wandb.init(project=stability.wandb_project, dir=str(run_dir), mode=stability.wandb_mode,
                                     config=run_config or {}, resume="allow", id=wandb_run_id(run_dir))

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        """Write one metrics record (or any dict of scalars) at `step`."""
        if self._tensorboard is None and self._wandb is None:
            return
        tagged = dashboard_scalars(scalars)
        if self._tensorboard is not None:
            for tag, value in tagged.items():
                self._tensorboard.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(tagged, step=step)

    def rewind(self, step: int) -> None:
        """Steps after `step` will be trained again (a rollback): TensorBoard drops its events past `step`, as
        `MetricsWriter.rewind` moves those records aside. W&B keeps its first values (see above)."""
        if self._tensorboard is not None:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            # What SummaryWriter(purge_step=...) writes, but into the open file: read after the events it purges.
            restart = Event(step=step + 1, session_log=SessionLog(status=SessionLog.START))
            self._tensorboard.file_writer.add_event(restart)

    def flush(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


# -- model monitor ----------------------------------------------------------------------------------------------
def layer_name(index: int, n_layers_total: int) -> str:
    """The name of position `index` in the flat list `[embedding, block0 … blockN-1, final_norm, head]`."""
    if index == 0:
        return "embedding"
    if index == n_layers_total - 1:
        return "head"
    if index == n_layers_total - 2:
        return "final_norm"
    return f"block{index - 1}"


def _local_layers(module: nn.Module) -> tuple[int, list[tuple[int, nn.Module]]]:
    """(length of the full layer list, [(index, layer)] for the layers this rank holds)."""
    if hasattr(module, "forward_funcs"):  # one pipeline stage (DeepSpeed PipelineModule)
        return len(pipeline_local_specs(module)[1]), local_layers(module)
    return len(module.layers), list(enumerate(module.layers))


def _counted_params(layers: Iterable[tuple[int, nn.Module]], topology: Topology) -> list[tuple[int, nn.Parameter]]:
    """(layer index, parameter) for every parameter this rank counts, by grad_norm.py's rule: shards on every TP
    rank, replicas on TP rank 0 only, tied pipeline copies not at all (the first stage counts them), and a
    Parameter shared between layers (the tied head) once, under its first layer (the embedding)."""
    tp_rank0 = topology.rank_in("tp") == 0
    seen: set[int] = set()
    counted = []
    for index, layer in layers:
        for p in layer.parameters():
            if id(p) in seen or not p.requires_grad or is_pipe_replicated(p):
                continue
            seen.add(id(p))
            if getattr(p, "tensor_model_parallel", False) or tp_rank0:
                counted.append((index, p))
    return counted


def _sq(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares in fp32 arithmetic (no fp64 copy of the tensor), returned as fp64 for accumulation."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float32).double() ** 2


def _is_engine(model: Any) -> bool:
    return hasattr(model, "module") and hasattr(model, "zero_optimization_stage")


class ModelMonitor:
    """Per-layer gradient norms, parameter norm, update/parameter ratio and per-block activation statistics.

    `model` is the DeepSpeed engine (or, without DeepSpeed, the plain `CausalLM`). Every rank constructs the
    monitor and makes the same calls: the last one reduces over the model-parallel group, and under ZeRO
    reading a gradient or an fp32 parameter is itself a collective over the data-parallel group.

    Per optimizer step `step` (1-based, the number the metrics record gets), on every rank:

    1. `arm(step)` before the step's first forward pass. On monitor steps it registers the activation hooks.
    2. forward/backward of every micro-batch.
    3. `before_step(step)` after the last micro-batch's backward (the accumulation boundary, gradients reduced
       over data parallel) and before `engine.step()`: DeepSpeed's step clips, unscales and then frees the
       gradients. On monitor steps it removes the hooks, reads the per-layer gradient norms and copies the
       parameters (a copy of this rank's parameters lives until `after_step`; under ZeRO-3 each parameter is
       gathered whole in fp32, so the copy is the rank's full fp32 model-parallel slice).
       With the pipeline engine, whose `train_batch` runs backward and step in one call, call `attach(engine)`
       once instead; `before_step` then runs inside DeepSpeed's step.
    4. `after_step(step)` after `engine.step()` (or `train_batch`): returns the scalars to merge into the
       metrics record, `{}` on other steps.

    Statistics: gradient norms are pre-clipping and unscaled (fp16) — the quantity DeepSpeed reports as the
    record's grad_norm, so their root-sum-square equals it. `params/norm` is ‖θ‖ after the step and
    `params/update_ratio` is ‖θ_after − θ_before‖ / ‖θ_after‖. Activation mean, std (population) and max-abs of
    each Block's output pool every token of the step's forward passes on this model replica (all its micro-batches;
    with sequence parallelism, all the TP ranks' shards); recomputation under activation checkpointing is ignored.
    """

    def __init__(self, model: nn.Module, topology: Topology, interval: int) -> None:
        self.engine = model if _is_engine(model) else None
        self.module: nn.Module = model.module if self.engine is not None else model
        self.topology = topology
        self.interval = interval
        total, local = _local_layers(self.module)
        self.names = [layer_name(i, total) for i in range(total)]
        self._params = _counted_params(local, topology)
        self._params_per_layer = [float(sum(index == i for index, _ in self._params)) for i in range(total)]
        self._blocks = [(index, layer) for index, layer in local if isinstance(layer, Block)]
        self._zero3 = self.engine is not None and self.engine.zero_optimization_stage() == 3
        self._device = next(self.module.parameters()).device
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._armed: int | None = None
        self._in_forward = False
        self._acts: torch.Tensor | None = None  # [layer, (tokens, sum, sum of squares, max-abs)]
        self._grad_sq: torch.Tensor | None = None  # [layer]
        self._snapshot: list[torch.Tensor] | None = None

    def is_monitor_step(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    # -- 1. before the forward passes ----------------------------------------------------------------------
    def arm(self, step: int) -> None:
        """Register the activation hooks for this step's forward passes, on monitor steps only."""
        self._remove_hooks()
        self._armed = step if self.is_monitor_step(step) else None
        if self._armed is None:
            return
        self._acts = torch.zeros(len(self.names), 4, dtype=torch.float64, device=self._device)
        # Count a Block only inside the model's own forward, not when activation checkpointing reruns it in backward.
        self._hooks.append(self.module.register_forward_pre_hook(lambda *_: self._set_in_forward(True)))
        self._hooks.append(self.module.register_forward_hook(lambda *_: self._set_in_forward(False),
                                                             always_call=True))
        for index, block in self._blocks:
            self._hooks.append(block.register_forward_hook(self._activation_hook(index)))

    def _set_in_forward(self, value: bool) -> None:
        self._in_forward = value

    def _activation_hook(self, index: int):
        def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
            if not self._in_forward:
                return
            with torch.no_grad():
                x = output.detach().float()
                var, mean = torch.var_mean(x, correction=0)
                lo, hi = torch.aminmax(x)
                n = x.numel()
                row = self._acts[index]
                row[0] += n
                row[1] += mean.double() * n
                row[2] += (var.double() + mean.double() ** 2) * n
                row[3] = torch.maximum(row[3], torch.maximum(hi, -lo).double())

        return hook

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._in_forward = False

    # -- 3. after backward, before the optimizer step ------------------------------------------------------
    def before_step(self, step: int) -> None:
        """Read gradients and copy parameters while DeepSpeed still holds this step's gradients."""
        self._armed = None
        if not self.is_monitor_step(step):
            return
        self._remove_hooks()
        scale = self._loss_scale()
        per_layer: list[list[torch.Tensor]] = [[] for _ in self.names]
        for index, p in self._params:
            grad = self._grad(p)
            if grad is not None:
                per_layer[index].append(_sq(grad))
        zero = torch.zeros((), dtype=torch.float64, device=self._device)
        self._grad_sq = torch.stack([torch.stack(sq).sum() if sq else zero for sq in per_layer]) / scale**2
        self._snapshot = [self._param_copy(p) for _, p in self._params]

    def attach(self, engine: Any) -> None:
        """Run `before_step` inside DeepSpeed's step, for the pipeline engine's `train_batch`.

        Runs inside DeepSpeed's model step (`wrap_model_step`), after gradients are reduced and before clipping and
        the update. Takes the step from the last `arm`. With this attached, the trainer must not call `before_step`.
        """

        def before_model_step() -> None:
            if self._armed is not None:
                self.before_step(self._armed)

        wrap_model_step(engine, before_model_step)

    def _loss_scale(self) -> float:
        """The factor this step's gradients still carry: fp16's dynamic loss scale, for ZeRO optimizers only.

        DeepSpeed's `engine.backward` multiplies the loss by the scale only when the optimizer is a ZeROOptimizer
        (fp16 at ZeRO ≥ 1); its step divides it out later. Its plain fp16 optimizers (ZeRO-0) see unscaled
        gradients. tests/test_monitor.py checks both against fp32.
        """
        if self.engine is None or not self.engine.fp16_enabled():
            return 1.0
        from deepspeed.runtime.base_optimizer import ZeROOptimizer

        if not isinstance(self.engine.optimizer, ZeROOptimizer):
            return 1.0
        return loss_scale(self.engine) or 1.0

    def _grad(self, p: nn.Parameter) -> torch.Tensor | None:
        if self.engine is None:
            return p.grad
        from deepspeed.utils import safe_get_full_grad  # p.grad, or ZeRO's partitioned buffers when it is None

        return safe_get_full_grad(p)

    def _param_copy(self, p: nn.Parameter) -> torch.Tensor:
        if self._zero3:
            from deepspeed.utils import safe_get_full_fp32_param

            return safe_get_full_fp32_param(p)  # a fresh gathered tensor: already a copy
        return p.detach().clone()

    # -- 4. after the optimizer step -----------------------------------------------------------------------
    def after_step(self, step: int) -> dict[str, float]:
        """The monitor scalars for the metrics record of `step` ({} unless a monitor step)."""
        if not self.is_monitor_step(step):
            return {}
        if self._snapshot is None or self._acts is None:
            raise RuntimeError(f"monitor: after_step({step}) needs arm({step}) before the forward passes and "
                               f"before_step({step}) before the optimizer step (or attach(engine))")
        param_sq = torch.zeros((), dtype=torch.float64, device=self._device)
        update_sq = torch.zeros_like(param_sq)
        for (_, p), old in zip(self._params, self._snapshot):
            new = self._param_copy(p) if self._zero3 else p.detach()
            param_sq += _sq(new)
            update_sq += _sq(new.float() - old.float())
        acts, grad_sq = self._acts, self._grad_sq
        self._snapshot = self._acts = self._grad_sq = None

        n_layers = len(self.names)
        grad_count = torch.tensor(self._params_per_layer, dtype=torch.float64, device=self._device)
        summed = torch.cat([grad_sq, grad_count, acts[:, :3].flatten(), param_sq.view(1), update_sq.view(1)])
        maxes = acts[:, 3].clone()
        model = self.topology.device("model")  # one sum for everything additive, one max
        comm.all_reduce(summed, model)
        comm.all_reduce(maxes, model, "max")
        values, maxes_list = summed.tolist(), maxes.tolist()  # the one device → host sync
        grad_sq_list, counts = values[:n_layers], values[n_layers:2 * n_layers]
        act_list = values[2 * n_layers:5 * n_layers]
        total_param_sq, total_update_sq = values[-2], values[-1]

        out = {"params/norm": math.sqrt(total_param_sq),
               "params/update_ratio": math.sqrt(total_update_sq / total_param_sq) if total_param_sq > 0 else 0.0}
        for name, sq, count in zip(self.names, grad_sq_list, counts):
            if count > 0:  # a tied head has no parameters of its own
                out[f"grad_norm/{name}"] = math.sqrt(sq)
        for index, name in enumerate(self.names):
            tokens, total, total_sq = act_list[3 * index:3 * index + 3]
            if tokens > 0:
                mean = total / tokens
                out[f"act/{name}/mean"] = mean
                out[f"act/{name}/std"] = math.sqrt(max(total_sq / tokens - mean * mean, 0.0))
                out[f"act/{name}/max_abs"] = maxes_list[index]
        return out

    def close(self) -> None:
        self._remove_hooks()
        self._snapshot = self._acts = self._grad_sq = None
