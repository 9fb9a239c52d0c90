"""Every DeepSpeed internal Keel reads or patches, in one place.

Keel uses DeepSpeed's public API wherever one exists. What is left below has no public equivalent in DeepSpeed 0.19
(each function says which public API is missing); nothing else in `keel/` touches a private DeepSpeed attribute,
except zero3_reader.py beside this file (the ZeRO-3 partition reader) and keel/engine/interleaved_engine.py,
Keel's interleaved 1F1B built on DeepSpeed's DualPipeV module and engine (its docstring says what it overrides and
why). probes.py holds the table of every internal used here and there, and `check_engine`, which probes them at
start-up.

DeepSpeed itself is imported inside the functions that use it (here and in probes.py): it takes about a second
to import and sets up its accelerator, and modules that never touch it import this package (the model's layers,
for `logical_shape`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from keel.adapters.deepspeed_internals.probes import (
    MUON,
    UNIVERSAL_PHASES,
    DeepSpeedInternalsError,
    accelerator,
    check_engine,
    clone_sites,
    comm_backend,
    expert_group_tables,
    fp16_scale_holder,
    groups_module,
    serves_new_group,
    universal_converter,
    wraps_optimizer,
)

__all__ = [
    "DeepSpeedInternalsError",
    "check_engine",
]  # re-exported: callers check an engine through the adapter


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
    return None if norm is None or not wraps_optimizer(engine) else norm


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
    return float(fp16_scale_holder(engine).cur_scale)


def pipeline_summed_loss(engine) -> torch.Tensor | None:
    """Inside `train_batch` at the step: the last stage's sum of this batch's micro-batch losses
    (`PipelineEngine.total_loss`); None on other stages. Missing public API: the batch loss before the step
    (`train_batch` returns it only afterwards)."""
    return engine.total_loss if engine.is_last_stage() else None


# -- start-up -------------------------------------------------------------------------------------------------------
def import_muon_compiling_on_first_use() -> None:
    """Import DeepSpeed's Muon optimizer with its kernels' `torch.compile` deferred to their first call.

    `deepspeed.initialize` with ZeRO checks the optimizer against its supported list, and first imports Muon there
    (`is_zero_supported_optimizer`); Muon's kernels are decorated with `torch.compile` at import, which imports
    inductor: about a second of every ZeRO rank's start-up, for an optimizer Keel does not use. Imported here
    first, each kernel compiles when it is first called, as DeepSpeed would have it; nothing else changes.
    Missing public API: a lazy `deepspeed.runtime.compiler.compile`."""
    if MUON in sys.modules:
        return
    compile_now = torch.compile

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: compile_later(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = compile_later
    try:
        importlib.import_module(MUON)
    except ImportError:  # DeepSpeed's own check tolerates its absence too
        pass
    finally:
        torch.compile = compile_now


# -- checkpoint files -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def route_checkpoint_writes(
    engine,
    route: Callable[[Callable, Any, str], None],
    elsewhere: Callable[[Callable[[], Any], str], None],
) -> Iterator[None]:
    """Inside: every change `engine.save_checkpoint` makes to the filesystem goes through Keel. Each file it writes
    goes through `route(save, state_dict, path)`, where `save(state_dict, target)` is DeepSpeed's own write
    (`target`: the path or a file object): DeepSpeed writes every model, optimizer and expert shard through
    `engine.checkpoint_engine.save(state_dict, path)`. Its other changes — the directories it makes
    (`checkpoint_engine.makedirs`) and the recovery scripts it copies beside the checkpoints
    (`engine._copy_recovery_script`: zero_to_fp32.py, zero_to_torch.py) — go through `elsewhere(do, path)`, where
    `do()` makes the change. Missing public API: a hook on the files `save_checkpoint` writes (to hash them, and
    to keep a failed write from skipping the save's closing barrier)."""
    checkpoint_engine = engine.checkpoint_engine
    save, makedirs = checkpoint_engine.save, checkpoint_engine.makedirs
    copy_scripts = engine._copy_recovery_script

    def routed_save(state_dict: Any, path: str) -> None:
        route(save, state_dict, path)

    def routed_makedirs(path: str, exist_ok: bool = False) -> None:
        elsewhere(lambda: makedirs(path, exist_ok=exist_ok), path)

    def routed_scripts(save_path: str) -> None:
        # the scripts' names are DeepSpeed's to choose: an error without a file name names them all
        elsewhere(lambda: copy_scripts(save_path), os.path.join(save_path, "zero_to_*.py"))

    with (
        _instead(checkpoint_engine, "save", routed_save),
        _instead(checkpoint_engine, "makedirs", routed_makedirs),
        _instead(engine, "_copy_recovery_script", routed_scripts),
    ):
        yield


@contextlib.contextmanager
def _instead(owner: Any, name: str, replacement: Callable) -> Iterator[None]:
    """Inside: `owner.name` is `replacement` (an instance attribute), then whatever was there before."""
    own = vars(owner).get(name)  # an instance attribute already there (else the class's method)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if own is None:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


@contextlib.contextmanager
def clones_for_save(clone: Callable[[Any], Any]) -> Iterator[None]:
    """Inside: where `save_checkpoint` clones a state dict for `torch.save` before its checkpoint engine saves it
    (`clone_tensors_for_torch_save(item)`, in the engine's and the pipeline module's save paths), `clone(item)`
    does it instead. Missing public API: a say in where save_checkpoint's host copies go (an asynchronous save
    snapshots into its own reused buffers; DeepSpeed's clone to the host first would be a second copy)."""
    sites = clone_sites()
    original = [site.clone_tensors_for_torch_save for site in sites]

    def routed(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
        if torch.device(device).type != "cpu":
            return original[0](item, device)
        return clone(item)

    for site in sites:
        site.clone_tensors_for_torch_save = routed
    try:
        yield
    finally:
        for site, own in zip(sites, original):
            site.clone_tensors_for_torch_save = own


# -- in-memory checkpoints -----------------------------------------------------------------------------------------
def engine_state(engine) -> dict[str, Any]:
    """This rank's whole engine state as live references (copy before the next step changes it): what
    `save_checkpoint` spreads over shared files, kept per rank so that a rank restores from its own bytes alone.
    The module's state (not under ZeRO-3, where the optimizer's fp32 partition is the parameters' only copy), the
    optimizer's (this rank's ZeRO partition, loss scaler included), the LR scheduler's and the engine's counters.
    Missing public API: a per-rank state dict of the engine (`save_checkpoint` writes some files on one rank of a
    data-parallel group only, and `load_checkpoint` reads them on all)."""
    optimizer, scheduler = engine.optimizer, engine.lr_scheduler
    return {
        "module": None
        if engine.zero_optimization_partition_weights()
        else engine.module.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
    }


def load_engine_state(engine, state: dict[str, Any]) -> None:
    """Restore what `engine_state` took, on the same layout, in the order `load_checkpoint` restores it: module,
    optimizer (a ZeRO optimizer from this rank's entry of the per-partition list it expects: the other entries
    are only read by an elastic checkpoint, which `check_engine_state` refuses), LR scheduler, counters.
    Missing public API: `load_checkpoint` from state already in memory (it reads every file from a directory)."""
    if engine._optimizer_has_ckpt_event_prologue():
        engine.optimizer.checkpoint_event_prologue()
    if state["module"] is not None:
        engine.module.load_state_dict(state["module"], strict=True)
    optimizer = engine.optimizer
    if optimizer is not None and engine.zero_optimization():
        partitions = [None] * dist.get_world_size(group=optimizer.dp_process_group)
        partitions[dist.get_rank(group=optimizer.dp_process_group)] = state["optimizer"]
        optimizer.load_state_dict(
            state_dict_list=partitions,
            load_optimizer_states=True,
            load_from_fp32_weights=engine.zero_load_from_fp32_weights(),
            checkpoint_folder=None,
            load_serial=None,
            param_shapes=engine._get_zero_param_shapes(),
        )
    elif optimizer is not None and (engine.fp16_enabled() or engine.bfloat16_enabled()):
        optimizer.load_state_dict(state["optimizer"], load_optimizer_states=True)
    elif optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if engine._optimizer_has_ckpt_event_epilogue():
        engine.optimizer.checkpoint_event_epilogue()
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
    engine.skipped_steps = state["skipped_steps"]


def check_engine_state(engine) -> str:
    """Why this engine's state cannot be kept per rank ("" when it can): an elastic ZeRO checkpoint merges every
    partition on load, and offloaded optimizer state lives outside the engine's state dicts."""
    if not engine.zero_optimization():
        return ""
    if engine.zero_elastic_checkpoint():
        return "zero_optimization.elastic_checkpoint is on (a rank's load reads every partition)"
    if engine.zero_nvme_offload_optimizer():
        return "the optimizer state is offloaded to NVMe (outside the engine's state dicts)"
    return ""


# -- universal checkpoints ------------------------------------------------------------------------------------------
class _HandedOff(Exception):
    """A converter other than the lead is done: the rest of the conversion is the lead's."""


def convert_to_universal(
    input_folder: str,
    output_folder: str,
    share: Callable[[Callable[[Any], Any], list], list],
    lead: bool,
) -> str:
    """DeepSpeed's `ds_to_universal` in this process, its two parallel phases — extract every ZeRO file's fragments,
    then merge each parameter's — handed to `share(do_work, items)` (which returns every item's result, from
    whichever process did it) instead of its process pool. Every converting process runs this; only the `lead`
    goes on past the merge (the files every rank reads, `latest_universal`). Returns what DeepSpeed printed.
    Missing public API: a way to split the conversion over processes on several hosts (its pool spans one)."""
    ds2u = universal_converter()
    phases_done = 0

    def spread(do_work: Callable[[Any], Any], items: list, num_workers: int) -> list:
        nonlocal phases_done
        results = share(do_work, list(items))
        phases_done += 1
        if phases_done == UNIVERSAL_PHASES and not lead:
            raise _HandedOff
        return results

    argv = ["ds_to_universal", "--input_folder", input_folder, "--output_folder", output_folder]
    argv += ["--inject_missing_state"]
    printed = io.StringIO()
    own = ds2u._do_parallel_work
    ds2u._do_parallel_work = spread
    try:
        with contextlib.redirect_stdout(printed), _argv(argv):
            ds2u.main(ds2u.parse_arguments())
    except _HandedOff:
        pass
    finally:
        ds2u._do_parallel_work = own
    return printed.getvalue()


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    own = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = own


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
        return [
            (int(start), list(funcs))
            for (start, _), funcs in zip(module.phase_bounds, module.phase_funcs)
        ]
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
        from deepspeed.utils import (
            safe_get_local_fp32_param,
            safe_get_local_optimizer_state,
        )  # lazy: see docstring

        out = {"fp32": safe_get_local_fp32_param(param), "partition": zero3_partition(param)}
        for key in _optimizer_state_keys(engine):
            out[key] = safe_get_local_optimizer_state(param, key)
        return {k: v for k, v in out.items() if v is not None}
    state = inner_optimizer(engine).state.get(param, {})
    return {
        "param": param.data,
        **{k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0},
    }


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
        from deepspeed.utils import safe_get_local_fp32_param  # lazy: see docstring

        master = safe_get_local_fp32_param(param)
        return (
            None
            if master is None
            else (master, zero3_partition(param).view(-1).narrow(0, 0, master.numel()))
        )
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
        from deepspeed.utils import safe_get_local_grad  # lazy: see docstring

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
    return part.view(-1), dist.get_rank(group=param.ds_process_group) * part.numel()


def register_expert_groups(
    name: str, ep_group, ep_ranks: list[int], edp_group, edp_ranks: list[int]
) -> None:
    """Give DeepSpeed caller-built expert groups under `name` (`deepspeed.utils.groups._EXPERT_*` tables).

    DeepSpeed looks expert groups up by name there (gradient reduction, ZeRO's MoE param groups, MoE checkpoints);
    its own builder would derive them from a different rank order. A single process has no groups of its own,
    so DeepSpeed gets a clone of the world group to address (`_clone_world_group`).
    """
    groups = expert_group_tables()
    single = groups._clone_world_group() if edp_group is None and dist.is_initialized() else None
    groups._EXPERT_PARALLEL_GROUP[name] = ep_group if ep_group is not None else single
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = list(ep_ranks)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group if edp_group is not None else single
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = list(edp_ranks)


# -- the accelerator ------------------------------------------------------------------------------------------------
def allow_fp16_on_cpu() -> bool:
    """DeepSpeed's CPU accelerator refuses fp16 although torch runs it: replace its `is_fp16_supported` (no
    public override exists). CPU only; returns True when applied, so the caller can say so."""
    cpu = accelerator()
    if cpu.device_name() != "cpu" or cpu.is_fp16_supported():
        return False
    cpu.is_fp16_supported = lambda: True
    return True


# -- several runs in one process ------------------------------------------------------------------------------------
@contextlib.contextmanager
def serve_group_requests(get: Callable[[list[int]], Any]) -> Iterator[None]:
    """While DeepSpeed builds (its PipelineModule's world group and grid, tied-weight and expert groups), every
    `deepspeed.comm.new_group(ranks)` it makes is answered by `get` (keel/parallel/process_groups.py): a rank
    set Keel already created is handed back, others are created by their members only. Missing public API: a
    way to give DeepSpeed's pipeline grid caller-built groups (`PipelineParallelGrid` creates its own, each a
    world-wide `new_group` on every rank, one of size 1 per rank at tp=1, again for every engine)."""
    backend = comm_backend()
    if backend is None:  # no process group: DeepSpeed creates no groups
        yield
        return
    if not serves_new_group():
        raise DeepSpeedInternalsError(
            "DeepSpeed's deepspeed.comm.new_group no longer asks cdb.new_group, which Keel answers with its own "
            "process groups; install a DeepSpeed in the range setup.py pins"
        )
    outer = backend.__dict__.get("new_group")  # an enclosing serve_group_requests
    backend.new_group = lambda ranks: get(list(ranks))  # shadows TorchBackend.new_group
    try:
        yield
    finally:
        if outer is None:
            del backend.new_group
        else:
            backend.new_group = outer


def forget_run_groups() -> None:
    """Drop the process groups one run handed DeepSpeed (`groups.mpu`, the expert-group tables), so the next run
    in the same process starts from DeepSpeed's initial state; `deepspeed.comm.destroy_process_group` releases
    these only on world teardown, which would end the sequence."""
    groups = groups_module()
    groups.mpu = None
    for table in (
        "_EXPERT_PARALLEL_GROUP",
        "_EXPERT_PARALLEL_GROUP_RANKS",
        "_EXPERT_DATA_PARALLEL_GROUP",
        "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
    ):
        getattr(groups, table).clear()
