"""Training monitoring: where in the model a run is going wrong (the dashboards: keel/training/observe/sinks.py).

A loss curve says *that* a run is in trouble; per-layer gradient norms, the update/parameter ratio and per-block
activation statistics say *where* (an embedding whose updates outgrow its weights, one block's activations
blowing up). `ModelMonitor` measures them every `interval` steps and returns flat scalars that go into the
metrics record, so metrics.jsonl and the dashboards carry the same numbers.

Ordinary steps cost nothing: no hooks are registered, no parameter is copied and nothing is reduced unless
the step is a monitor step (`step % interval == 0`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from torch import nn

from keel.adapters.deepspeed_internals import (
    inner_optimizer,
    is_partitioned,
    is_pipe_replicated,
    local_grad,
    loss_scale,
    master_state,
    pipeline_layer_specs,
    update_pair,
    wrap_model_step,
)
from keel.engine.pipeline import local_layers
from keel.model import Block
from keel.parallel import comm
from keel.parallel.topology import Topology
from keel.training.observe.attention_logits import PREFIX, SUFFIX, AttentionLogitProbes
from keel.training.observe.fp8_health import Fp8Probes


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
        return len(pipeline_layer_specs(module)), local_layers(module)
    return len(module.layers), list(enumerate(module.layers))


def _counted_params(
    layers: Iterable[tuple[int, nn.Module]], topology: Topology
) -> list[tuple[int, nn.Parameter]]:
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


# elements per chunk of an update's difference: 4 MiB of fp32 temporaries per tensor
CHUNK = 1 << 20


def _sq(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares in fp32 arithmetic (no fp64 copy of the tensor), returned as fp64 for accumulation."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float32).double() ** 2


def _diff_sq(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """‖new − old‖² in fixed chunks (bounded temporaries), fp64 on the device. `new` is first rounded to `old`'s
    dtype: for an fp32 master against a bf16/fp16 working copy, this is the update the working weights get."""
    new, old = new.detach().reshape(-1), old.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=new.device)
    for start in range(0, new.numel(), CHUNK):
        chunk = new[start : start + CHUNK].to(old.dtype).float()
        total += _sq(chunk - old[start : start + CHUNK].float())
    return total


def _share(t: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """This replica's 1/parts slice of a replicated tensor (a view), so replicas split the work and the sums."""
    flat = t.detach().reshape(-1)
    step = -(-flat.numel() // parts)
    return flat[index * step : (index + 1) * step]


def _is_engine(model: Any) -> bool:
    return hasattr(model, "module") and hasattr(model, "zero_optimization_stage")


class ModelMonitor:
    """Per-layer gradient norms, parameter norm, update/parameter ratio and per-block activation statistics.

    `model` is the DeepSpeed engine (or, without DeepSpeed, the plain `CausalLM`). Every rank constructs the
    monitor and makes the same calls. Memory follows the shard: each rank reads only what it holds — its ZeRO
    partition's gradient and fp32 fragments (ZeRO-1/2/3, bf16), or its 1/replicas slice of a replicated parameter
    (ZeRO-0) — and sums of squares are reduced over the world in one all-reduce (plus one for the maxima).

    Per optimizer step `step` (1-based, the number the metrics record gets), on every rank:

    1. `arm(step)` before the step's first forward pass. On monitor steps it registers the activation hooks.
    2. forward/backward of every micro-batch.
    3. `before_step(step)` after the last micro-batch's backward (the accumulation boundary, gradients reduced
       over data parallel) and before `engine.step()`: DeepSpeed's step clips, unscales and then frees the
       gradients. On monitor steps it removes the hooks and reads the per-layer gradient norms. The update's
       norm is taken inside the step: where DeepSpeed keeps an fp32 master partition, right after the torch
       optimizer's update and before DeepSpeed copies it back, as master − working copy, chunk by chunk (no copy);
       at plain ZeRO-0 (no master copy) this rank keeps its 1/replicas slice of the parameters until `after_step`.
       With the pipeline engine, whose `train_batch` runs backward and step in one call, call `attach(engine)`
       once instead; `before_step` then runs inside DeepSpeed's step.
    4. `after_step(step)` after `engine.step()` (or `train_batch`): returns the scalars to merge into the
       metrics record, `{}` on other steps.

    Statistics: gradient norms are pre-clipping and unscaled (fp16) — the quantity DeepSpeed reports as the
    record's grad_norm, so their root-sum-square equals it. `params/norm` is ‖θ‖ after the step (the fp32 master
    where there is one) and `params/update_ratio` is ‖θ_after − θ_before‖ / ‖θ_after‖. Activation mean, std
    (population) and max-abs of each Block's output pool every token of the step's forward passes on every rank
    (the global batch; with tensor parallelism each replica's tokens count once per TP rank, which leaves these
    statistics unchanged); recomputation under activation checkpointing is ignored.
    """

    def __init__(self, model: nn.Module, topology: Topology, interval: int) -> None:
        self.engine = model if _is_engine(model) else None
        self.module: nn.Module = model.module if self.engine is not None else model
        self.topology = topology
        self.interval = interval
        total, local = _local_layers(self.module)
        self.names = [layer_name(i, total) for i in range(total)]
        self._params = _counted_params(local, topology)
        self._params_per_layer = [
            float(sum(index == i for index, _ in self._params)) for i in range(total)
        ]
        self._blocks = [(index, layer) for index, layer in local if isinstance(layer, Block)]
        self._probes = AttentionLogitProbes(
            self._blocks, total, next(self.module.parameters()).device
        )
        self._fp8 = Fp8Probes(self._blocks, total, next(self.module.parameters()).device)
        self._partitioned = [self.engine is not None and is_partitioned(p) for _, p in self._params]
        # a replicated (not partitioned) parameter is split among its replicas: (index, parts) per parameter
        self._shares = [
            (0, 1) if part else (topology.rank_in(g), topology.size(g))
            for part, g in zip(
                self._partitioned,
                (
                    "sp_dp" if getattr(p, "allreduce", True) else "expert_dp"
                    for _, p in self._params
                ),
            )
        ]
        self._device = next(self.module.parameters()).device
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        # [layer] the largest attention logit (-inf: no attention here)
        self._logits: torch.Tensor | None = None
        self._fp8_values: torch.Tensor | None = (
            None  # [layer × operand × stat] (-1: no FP8 linear here)
        )
        self._armed: int | None = None
        self._in_forward = False
        self._acts: torch.Tensor | None = None  # [layer, (tokens, sum, sum of squares, max-abs)]
        self._grad_sq: torch.Tensor | None = None  # [layer]
        # ZeRO-0: this rank's slices before the step
        self._snapshot: list[torch.Tensor | None] | None = None
        self._update_sq: torch.Tensor | None = None
        self._updated: set[int] = set()
        if any(self._partitioned):
            inner_optimizer(self.engine).register_step_post_hook(self._after_inner_step)

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
        self._hooks.append(
            self.module.register_forward_pre_hook(lambda *_: self._set_in_forward(True))
        )
        self._hooks.append(
            self.module.register_forward_hook(
                lambda *_: self._set_in_forward(False), always_call=True
            )
        )
        for index, block in self._blocks:
            self._hooks.append(block.register_forward_hook(self._activation_hook(index)))
        self._probes.arm()
        self._fp8.arm()

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
        self._probes.disarm()
        self._fp8.disarm()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._in_forward = False

    # -- 3. after backward, before the optimizer step ------------------------------------------------------
    def before_step(self, step: int) -> None:
        """Read this rank's gradient shards (no collective); at plain ZeRO-0 keep this rank's parameter slices."""
        self._armed = None
        if not self.is_monitor_step(step):
            return
        self._logits = self._probes.read()  # the forward passes are done: read before disarming
        self._fp8_values = self._fp8.read()  # ...and the backward passes (the gradients' casts)
        self._remove_hooks()
        scale = self._loss_scale()
        per_layer: list[list[torch.Tensor]] = [[] for _ in self.names]
        for (index, p), share in zip(self._params, self._shares):
            grad = local_grad(p) if self.engine is not None else p.grad
            if grad is not None:
                per_layer[index].append(_sq(_share(grad, *share)))
        zero = torch.zeros((), dtype=torch.float64, device=self._device)
        self._grad_sq = (
            torch.stack([torch.stack(sq).sum() if sq else zero for sq in per_layer]) / scale**2
        )
        self._snapshot = [
            None if part else _share(p, *share).clone()
            for (_, p), part, share in zip(self._params, self._partitioned, self._shares)
        ]
        self._update_sq, self._updated = zero.clone(), set()

    def _after_inner_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """After the torch optimizer updated (some of) the fp32 master partitions and before DeepSpeed copies them
        into the working weights: the update is master − working copy, for the parameters just stepped."""
        if self._update_sq is None:
            return
        stepped = {
            q.untyped_storage().data_ptr()
            for group in optimizer.param_groups
            for q in group["params"]
        }
        for i, ((_, p), part) in enumerate(zip(self._params, self._partitioned)):
            pair = update_pair(p) if part and i not in self._updated else None
            if pair is not None and pair[0].untyped_storage().data_ptr() in stepped:
                self._updated.add(i)
                self._update_sq += _diff_sq(*pair)

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
        if not isinstance(self.engine.optimizer, ZeROOptimizer):
            return 1.0
        return loss_scale(self.engine) or 1.0

    def _value(
        self, p: nn.Parameter, partitioned: bool, share: tuple[int, int]
    ) -> torch.Tensor | None:
        """This rank's part of θ after the step: its fp32 master fragment, or its slice of the replicated θ."""
        if partitioned:
            return master_state(self.engine, p).get("fp32")
        return _share(p, *share)

    # -- 4. after the optimizer step -----------------------------------------------------------------------
    def after_step(self, step: int) -> dict[str, float]:
        """The monitor scalars for the metrics record of `step` ({} unless a monitor step)."""
        if not self.is_monitor_step(step):
            return {}
        if self._snapshot is None or self._acts is None:
            raise RuntimeError(
                f"monitor: after_step({step}) needs arm({step}) before the forward passes and "
                f"before_step({step}) before the optimizer step (or attach(engine))"
            )
        param_sq = torch.zeros((), dtype=torch.float64, device=self._device)
        update_sq = self._update_sq
        for (_, p), part, share, old in zip(
            self._params, self._partitioned, self._shares, self._snapshot
        ):
            new = self._value(p, part, share)
            if new is not None:
                param_sq += _sq(new)
            if old is not None:
                update_sq += _diff_sq(new, old)
        acts, grad_sq = self._acts, self._grad_sq
        self._snapshot = self._acts = self._grad_sq = self._update_sq = None

        n_layers = len(self.names)
        grad_count = torch.tensor(self._params_per_layer, dtype=torch.float64, device=self._device)
        summed = torch.cat(
            [grad_sq, grad_count, acts[:, :3].flatten(), param_sq.view(1), update_sq.view(1)]
        )
        maxes = torch.cat([acts[:, 3], self._logits, self._fp8_values])
        self._logits = self._fp8_values = None
        world = self.topology.device("world")  # one sum for everything additive, one max
        comm.all_reduce(summed, world)
        comm.all_reduce(maxes, world, "max")
        values, maxes_list = summed.tolist(), maxes.tolist()  # the one device → host sync
        maxes_list, logit_list, fp8_list = (
            maxes_list[:n_layers],
            maxes_list[n_layers : 2 * n_layers],
            maxes_list[2 * n_layers :],
        )
        grad_sq_list, counts = values[:n_layers], values[n_layers : 2 * n_layers]
        act_list = values[2 * n_layers : 5 * n_layers]
        total_param_sq, total_update_sq = values[-2], values[-1]

        out = {
            "params/norm": math.sqrt(total_param_sq),
            "params/update_ratio": math.sqrt(total_update_sq / total_param_sq)
            if total_param_sq > 0
            else 0.0,
        }
        for name, sq, count in zip(self.names, grad_sq_list, counts):
            if count > 0:  # a tied head has no parameters of its own
                out[f"grad_norm/{name}"] = math.sqrt(sq)
        for index, name in enumerate(self.names):
            tokens, total, total_sq = act_list[3 * index : 3 * index + 3]
            if tokens > 0:
                mean = total / tokens
                out[f"act/{name}/mean"] = mean
                out[f"act/{name}/std"] = math.sqrt(max(total_sq / tokens - mean * mean, 0.0))
                out[f"act/{name}/max_abs"] = maxes_list[index]
        for name, logit in zip(self.names, logit_list):
            if logit > float("-inf"):
                out[f"{PREFIX}{name}{SUFFIX}"] = logit
        out.update(Fp8Probes.record(self.names, fp8_list))
        return out

    def close(self) -> None:
        self._remove_hooks()
        self._probes.disarm()
        self._snapshot = self._acts = self._grad_sq = self._update_sq = None
