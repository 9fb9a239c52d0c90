"""Every DeepSpeed internal Keel reads or patches, in one place.

Keel uses DeepSpeed's public API wherever one exists. What is left below has no public equivalent in DeepSpeed 0.19
(each function says which public API is missing); nothing else in `keel/` touches a private DeepSpeed attribute,
except the two files beside this one: interleaved.py, Keel's interleaved 1F1B built on DeepSpeed's DualPipeV module
and engine (its docstring says what it overrides and why), and zero3_reader.py, the ZeRO-3 partition reader.
`check_engine` probes every internal an engine of that kind needs, so an upgrade that removes one fails at start-up
— and in tests/test_adapters.py — with one line naming the attribute, not mid-run.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


class DeepSpeedInternalsError(RuntimeError):
    """A DeepSpeed internal Keel relies on is gone: the installed DeepSpeed is outside the verified range."""


@dataclass(frozen=True)
class Internal:
    name: str  # what is read or patched, as written in DeepSpeed
    missing_api: str  # the public API that would replace it
    applies: Callable[[Any], bool]  # does an engine of this kind need it?
    probe: Callable[[Any], bool]  # is it there?


def _has_path(obj: Any, path: str) -> bool:
    for part in path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _wraps_optimizer(engine) -> bool:
    """ZeRO, bf16 and fp16 engines put a DeepSpeed wrapper around the torch optimizer; plain fp32 ZeRO-0 does not."""
    return not isinstance(engine.optimizer, torch.optim.Optimizer)


def _is_pipeline(engine) -> bool:
    return hasattr(engine, "train_batch") and hasattr(engine.module, "forward_funcs")


def _is_dualpipev(engine) -> bool:
    from deepspeed.pipe import DualPipeVModule

    return isinstance(engine.module, DualPipeVModule)


def _is_interleaved(engine) -> bool:
    return type(engine).__name__ == "InterleavedEngine"  # interleaved.py, which imports DeepSpeed's pipe engine


# what Keel's interleaved 1F1B (interleaved.py) overrides or relies on in DeepSpeed's DualPipeV classes
DUALPIPEV_MACHINERY = ("_phase", "_first_send", "_recv_specs", "_queue_p2p", "_downstream_stage", "_upstream_stage",
                       "_is_loss_stage", "_is_last_rank", "_loss_stage_global_rank", "_INSTRUCTION_MAP")
DUALPIPEV_MODULE_MACHINERY = ("phase_bounds", "phase_funcs", "phase_checkpointable", "activate_phase", "_set_bounds")


def _plain_fp32(engine) -> bool:
    return engine.zero_optimization_stage() == 0 and not engine.fp16_enabled() and not engine.bfloat16_enabled()


def _fp16_scale_holder(engine):
    optimizer = engine.optimizer
    return getattr(optimizer, "loss_scale_config", optimizer)


INTERNALS = [
    Internal("optimizer.optimizer", "a public accessor for the torch optimizer inside ZeRO/bf16/fp16 wrappers",
             _wraps_optimizer, lambda e: isinstance(getattr(e.optimizer, "optimizer", None), torch.optim.Optimizer)),
    Internal("optimizer._global_grad_norm", "the step's global grad norm before the update (engine."
             "get_global_grad_norm() is set only after it)", _wraps_optimizer,
             lambda e: hasattr(e.optimizer, "_global_grad_norm")),
    Internal("optimizer.overflow", "a way to veto one optimizer step (DeepSpeed reads this flag after step())",
             lambda e: True, lambda e: "overflow" in type(e)._take_model_step.__code__.co_names),
    Internal("engine._take_model_step", "a hook between gradient reduction and the update", lambda e: True,
             lambda e: callable(getattr(e, "_take_model_step", None))),
    Internal("engine.clip_fp32_gradients", "a clipping hook for the fp32 ZeRO-0 path", _plain_fp32,
             lambda e: "clip_fp32_gradients" in type(e)._take_model_step.__code__.co_names),
    Internal("optimizer.cur_scale / loss_scale_config.cur_scale", "the current dynamic loss scale",
             lambda e: e.fp16_enabled(), lambda e: hasattr(_fp16_scale_holder(e), "cur_scale")),
    Internal("PipelineEngine.total_loss", "the last stage's summed micro-batch losses inside train_batch",
             _is_pipeline, lambda e: hasattr(e, "total_loss")),
    Internal("PipelineModule._layer_specs / _local_start (DualPipeVModule: phase_bounds / phase_funcs)",
             "a rank's stages of the layer list", _is_pipeline,
             lambda e: hasattr(e.module, "_layer_specs") and (
                 all(hasattr(e.module, a) for a in ("phase_bounds", "phase_funcs")) if _is_dualpipev(e)
                 else hasattr(e.module, "_local_start"))),
    Internal(f"DualPipeVEngine {', '.join(DUALPIPEV_MACHINERY)}; DualPipeVModule "
             f"{', '.join(DUALPIPEV_MODULE_MACHINERY)}", "an engine and a module that run more than two stages per "
             "rank (interleaved 1F1B)", _is_interleaved,
             lambda e: all(hasattr(e, a) for a in DUALPIPEV_MACHINERY)
             and all(hasattr(e.module, a) for a in DUALPIPEV_MODULE_MACHINERY)),
    Internal("deepspeed.utils.groups._EXPERT_PARALLEL_GROUP (+ _RANKS, _EXPERT_DATA_PARALLEL_GROUP, _RANKS) and "
             "_clone_world_group", "registering caller-built expert groups", lambda e: True,
             lambda e: _expert_group_tables() is not None),
    Internal("deepspeed.utils.groups.mpu", "resetting the groups a finished run handed DeepSpeed", lambda e: True,
             lambda e: _has_path(_groups_module(), "mpu")),
    Internal("param.ds_tensor", "this rank's ZeRO-3 partition without a gather", lambda e:
             e.zero_optimization_stage() == 3, lambda e: any(hasattr(p, "ds_tensor") for p in e.module.parameters())),
    Internal("param._hp_mapping (hp_fragment, lp_fragment, optim_fragment)", "this rank's fp32 partition and optimizer "
             "state of one parameter under ZeRO-1/2 and bf16 (safe_get_local_fp32_param is ZeRO-3 only)",
             lambda e: _wraps_optimizer(e) and e.zero_optimization_stage() < 3,
             lambda e: any(all(hasattr(getattr(p, "_hp_mapping", None), a) for a in
                               ("hp_fragment", "lp_fragment", "optim_fragment")) for p in e.module.parameters())),
    Internal("param.ds_pipe_replicated", "which parameters are pipeline replicas", _is_pipeline,
             lambda e: any("ds_pipe_replicated" in inspect.getsource(cls) for cls in type(e.module).__mro__
                           if cls.__module__.startswith("deepspeed."))),
    Internal("engine.checkpoint_engine.save", "a hook on each file save_checkpoint writes", lambda e: True,
             lambda e: callable(getattr(getattr(e, "checkpoint_engine", None), "save", None))),
    Internal("accelerator.is_fp16_supported", "an fp16 override for the CPU accelerator", lambda e: True,
             lambda e: _has_path(_accelerator(), "is_fp16_supported")),
]


def check_engine(engine) -> None:
    """Raise one line naming the first internal this engine needs that the installed DeepSpeed lacks."""
    import deepspeed

    for internal in INTERNALS:
        if internal.applies(engine) and not internal.probe(engine):
            raise DeepSpeedInternalsError(
                f"DeepSpeed {deepspeed.__version__} has no `{internal.name}`, which Keel uses for want of "
                f"{internal.missing_api}; install a DeepSpeed in the range setup.py pins")


# -- the optimizer step ---------------------------------------------------------------------------------------------
def inner_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (`optimizer.optimizer`), or the engine's own.
    Missing public API: an accessor for the wrapped torch optimizer."""
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def raw_grad_norm_before_update(engine) -> torch.Tensor | float | None:
    """The global norm DeepSpeed computed for this step (`optimizer._global_grad_norm`, set before the inner
    optimizer steps), as DeepSpeed holds it (often a device scalar: not read back here; -1 if non-finite); None
    where DeepSpeed computes none (fp32 ZeRO-0, where Keel clips itself).
    Missing public API: the norm before the update (`engine.get_global_grad_norm()` is only set after it)."""
    norm = getattr(engine.optimizer, "_global_grad_norm", None)
    return None if norm is None or not _wraps_optimizer(engine) else norm


def host_grad_norm(norm: float | None) -> float | None:
    """A norm read back to the host, DeepSpeed's -1 mark of a non-finite norm turned into NaN."""
    return None if norm is None else (math.nan if norm < 0 else float(norm))


def grad_norm_before_update(engine) -> float | None:
    """`raw_grad_norm_before_update` read back to the host (one sync)."""
    norm = raw_grad_norm_before_update(engine)
    return host_grad_norm(None if norm is None else float(norm))


def veto_step(engine, vetoed: bool) -> None:
    """Set `optimizer.overflow`, which DeepSpeed reads right after `step()` to count a skipped step and hold the
    LR schedule; the plain torch optimizer (ZeRO-0 fp32) gets the attribute as DeepSpeed's wrappers have it.
    Missing public API: a veto of one optimizer step."""
    engine.optimizer.overflow = vetoed


def wrap_model_step(engine, before: Callable[[], None]) -> None:
    """Call `before()` inside `engine._take_model_step`: both engines call it at the accumulation boundary, after
    gradients are reduced and before clipping and the update (the pipeline's `train_batch` leaves no other gap).
    Missing public API: a hook between gradient reduction and the update."""
    take_model_step = engine._take_model_step

    def take_model_step_then(*args: Any, **kwargs: Any) -> Any:
        before()
        return take_model_step(*args, **kwargs)

    engine._take_model_step = take_model_step_then


def replace_fp32_clipping(engine, clip: Callable[[], Any]) -> None:
    """DeepSpeed calls `engine.clip_fp32_gradients()` right before the fp32 ZeRO-0 update; Keel's replacement
    clips by the model-parallel-aware norm and records it (DeepSpeed's neither records nor sums over stages).
    Missing public API: a clipping hook for the fp32 ZeRO-0 path."""
    engine.clip_fp32_gradients = clip


def loss_scale(engine) -> float | None:
    """fp16's current dynamic loss scale (`cur_scale`, after this step's update); None in fp32/bf16.
    Missing public API: a getter for the dynamic loss scale."""
    if not engine.fp16_enabled():
        return None
    return float(_fp16_scale_holder(engine).cur_scale)


def pipeline_summed_loss(engine) -> torch.Tensor | None:
    """Inside `train_batch` at the step: the last stage's sum of this batch's micro-batch losses
    (`PipelineEngine.total_loss`); None on other stages. Missing public API: the batch loss before the step
    (`train_batch` returns it only afterwards)."""
    return engine.total_loss if engine.is_last_stage() else None


# -- checkpoint files -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def route_checkpoint_writes(engine, route: Callable[[Callable, Any, str], None]) -> Iterator[None]:
    """Inside: each file `engine.save_checkpoint` writes goes through `route(save, state_dict, path)`, where
    `save(state_dict, target)` is DeepSpeed's own write (`target`: the path or a file object). DeepSpeed writes
    every model, optimizer and expert shard through `engine.checkpoint_engine.save(state_dict, path)`.
    Missing public API: a hook on the files `save_checkpoint` writes (to hash them, and to keep a failed write
    from skipping the save's closing barrier)."""
    checkpoint_engine = engine.checkpoint_engine
    save = checkpoint_engine.save
    own = vars(checkpoint_engine).get("save")  # an instance attribute already there (else the class's method)

    def routed(state_dict: Any, path: str) -> None:
        route(save, state_dict, path)

    checkpoint_engine.save = routed
    try:
        yield
    finally:
        if own is None:
            del checkpoint_engine.save
        else:
            checkpoint_engine.save = own


# -- model structure --------------------------------------------------------------------------------------------------
def pipeline_layer_specs(module) -> list:
    """The full layer-spec list of a `PipelineModule` (`_layer_specs`). Missing public API: the layer list a
    stage was cut from."""
    return list(module._layer_specs)


def pipeline_local_chunks(module) -> list[tuple[int, list]]:
    """(index of the first layer, the layer callables) of each stage this rank holds, in schedule order: one for a
    `PipelineModule` (`_local_start`, `forward_funcs`), phase by phase for a `DualPipeVModule` and Keel's
    `InterleavedModule` (`phase_bounds`, `phase_funcs`). Missing public API: a rank's stages of the layer list."""
    if hasattr(module, "phase_bounds"):
        return [(int(start), list(funcs)) for (start, _), funcs in zip(module.phase_bounds, module.phase_funcs)]
    return [(int(module._local_start), list(module.forward_funcs))]


def is_pipe_replicated(param: torch.nn.Parameter) -> bool:
    """A tied copy on a later pipeline stage (DeepSpeed marks it `ds_pipe_replicated`); counted once, on the first.
    Missing public API: which parameters are pipeline replicas."""
    return bool(getattr(param, "ds_pipe_replicated", False))


def zero3_partition(param: torch.nn.Parameter) -> torch.Tensor:
    """Under ZeRO-3 the rank's own partition (`ds_tensor`); outside forward the parameter itself is empty.
    Missing public API: this rank's partition without gathering (`safe_get_local_fp32_param` copies to fp32)."""
    return getattr(param, "ds_tensor", param)


def master_state(engine, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """This rank's own copy of what the optimizer treats as the truth for `param`, as views (no copies):

    - ZeRO-1/2 (and DeepSpeed's bf16 optimizer): the fp32 fragment of the rank's partition and its optimizer
      state (`param._hp_mapping`); {} where the parameter lies outside this rank's partition.
    - ZeRO-3: the fp32 partition and optimizer state (public `safe_get_local_*`) and the working partition
      (`ds_tensor`) the next forward gathers.
    - ZeRO-0: the parameter itself and its optimizer state.
    Missing public API: `safe_get_local_fp32_param` / `safe_get_local_optimizer_state` for ZeRO-1/2."""
    if hasattr(param, "_hp_mapping"):
        mapping = param._hp_mapping
        if mapping is None:
            return {}
        return {"fp32": mapping.hp_fragment, **(mapping.optim_fragment or {})}
    if hasattr(param, "ds_id"):
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        out = {"fp32": safe_get_local_fp32_param(param), "partition": zero3_partition(param)}
        for key in _optimizer_state_keys(engine):
            out[key] = safe_get_local_optimizer_state(param, key)
        return {k: v for k, v in out.items() if v is not None}
    state = inner_optimizer(engine).state.get(param, {})
    return {"param": param.data, **{k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}}


def _optimizer_state_keys(engine) -> list[str]:
    """The per-element optimizer state names (exp_avg, exp_avg_sq for Adam); [] before the first step."""
    for state in inner_optimizer(engine).state.values():
        return [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0]
    return []


def update_pair(param: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(this rank's fp32 master values, the working copy the forward uses) for `param`, as views of equal size;
    between the inner optimizer's step and DeepSpeed's copy-back they differ by exactly this step's update.
    ZeRO-1/2 and bf16: `_hp_mapping.hp_fragment` / `lp_fragment`; ZeRO-3: the fp32 partition / `ds_tensor`;
    None at plain ZeRO-0 (no master copy) or where the parameter is outside this rank's partition.
    Missing public API: the parameter's working-copy fragment that pairs with its local fp32 fragment."""
    if hasattr(param, "_hp_mapping"):
        mapping = param._hp_mapping
        return None if mapping is None else (mapping.hp_fragment, mapping.lp_fragment)
    if hasattr(param, "ds_id"):
        from deepspeed.utils import safe_get_local_fp32_param

        master = safe_get_local_fp32_param(param)
        return None if master is None else (master, zero3_partition(param).view(-1).narrow(0, 0, master.numel()))
    return None


def is_partitioned(param: torch.nn.Parameter) -> bool:
    """Does a ZeRO optimizer (or DeepSpeed's bf16 one) hold this parameter's master copy partitioned across data
    parallel ranks (`_hp_mapping` at ZeRO-1/2, `ds_id` at ZeRO-3)? Missing public API: which parameters are."""
    return hasattr(param, "_hp_mapping") or hasattr(param, "ds_id")


def local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's share of `param`'s reduced gradient, without a collective: ZeRO-1/2 the fragment of its
    partition (`_hp_mapping.get_lp_grad_fragment`), ZeRO-3 its partition (public `safe_get_local_grad`),
    otherwise `param.grad`. Valid between the gradient reduction and the optimizer step.
    Missing public API: `safe_get_local_grad` for ZeRO-1/2."""
    if hasattr(param, "_hp_mapping"):
        mapping = param._hp_mapping
        if mapping is None:
            return None
        return mapping.get_lp_grad_fragment(param._index_in_param_group)
    if hasattr(param, "ds_id"):
        from deepspeed.utils import safe_get_local_grad

        return safe_get_local_grad(param)
    return param.grad


def logical_shape(param: torch.nn.Parameter) -> torch.Size:
    """A parameter's shape, also while ZeRO-3 has partitioned it (`ds_shape`; the tensor itself is then empty).
    Missing public API: the shape of a partitioned parameter without gathering it."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def zero3_partition_window(param: torch.nn.Parameter) -> tuple[torch.Tensor, int] | None:
    """(this rank's ZeRO-3 partition as a flat tensor, its first element's index in the flattened parameter), or
    None when `param` is not partitioned. Missing public API: writing a rank's partition in place (the public
    `GatheredParameters` gathers the whole parameter first)."""
    part = getattr(param, "ds_tensor", None)
    if part is None:
        return None
    import torch.distributed as dist

    return part.view(-1), dist.get_rank(group=param.ds_process_group) * part.numel()


def _groups_module():
    from deepspeed.utils import groups

    return groups


def _expert_group_tables():
    groups = _groups_module()
    names = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
             "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_clone_world_group")
    return groups if all(hasattr(groups, n) for n in names) else None


def register_expert_groups(name: str, ep_group, ep_ranks: list[int], edp_group, edp_ranks: list[int]) -> None:
    """Give DeepSpeed caller-built expert groups under `name` (`deepspeed.utils.groups._EXPERT_*` tables).

    DeepSpeed looks expert groups up by name there (gradient reduction, ZeRO's MoE param groups, MoE checkpoints);
    its own builder would derive them from a different rank order. A single process has no groups of its own,
    so DeepSpeed gets a clone of the world group to address (`_clone_world_group`).
    """
    import torch.distributed as dist

    groups = _expert_group_tables()
    single = groups._clone_world_group() if edp_group is None and dist.is_initialized() else None
    groups._EXPERT_PARALLEL_GROUP[name] = ep_group if ep_group is not None else single
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = list(ep_ranks)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group if edp_group is not None else single
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = list(edp_ranks)


# -- the accelerator ------------------------------------------------------------------------------------------------
def _accelerator():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def allow_fp16_on_cpu() -> bool:
    """DeepSpeed's CPU accelerator refuses fp16 although torch runs it: replace its `is_fp16_supported` (no
    public override exists). CPU only; returns True when applied, so the caller can say so."""
    accelerator = _accelerator()
    if accelerator.device_name() != "cpu" or accelerator.is_fp16_supported():
        return False
    accelerator.is_fp16_supported = lambda: True
    return True


# -- several runs in one process ------------------------------------------------------------------------------------
def forget_run_groups() -> None:
    """Drop the process groups one run handed DeepSpeed (`groups.mpu`, the expert-group tables), so the next run
    in the same process starts from DeepSpeed's initial state; `deepspeed.comm.destroy_process_group` releases
    these only on world teardown, which would end the sequence."""
    groups = _groups_module()
    groups.mpu = None
    for table in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                  "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):
        getattr(groups, table).clear()
