"""The probe table: every DeepSpeed internal Keel reads or patches, which engines need it, and how to see it is there.

`check_engine` runs every probe an engine of that kind needs at start-up (and tests/test_adapters.py runs them
all), so an upgrade that removes an internal fails with one line naming it, not mid-run. The accessors that use
these internals are in `keel.adapters.deepspeed_internals` (the package's `__init__`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
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


def wraps_optimizer(engine) -> bool:
    """ZeRO, bf16 and fp16 engines put a DeepSpeed wrapper around the torch optimizer; plain fp32 ZeRO-0 does not."""
    return not isinstance(engine.optimizer, torch.optim.Optimizer)


# DeepSpeed's Muon optimizer, which its ZeRO optimizer check imports (keel.adapters.deepspeed_internals
# `import_muon_compiling_on_first_use`)
MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def _muon_imported_by_the_zero_check() -> bool:
    """The import Keel makes first (keel.adapters.deepspeed_internals.import_muon_compiling_on_first_use) is the
    one DeepSpeed's ZeRO optimizer check makes, and its kernels go through `deepspeed.runtime.compiler.compile`."""
    from deepspeed.runtime.zero import utils  # lazy: see the package docstring

    try:
        muon = importlib.import_module("deepspeed.runtime.zero.muon.original_muon")
    except ImportError:
        return MUON not in inspect.getsource(utils.is_zero_supported_optimizer)
    return MUON in inspect.getsource(utils.is_zero_supported_optimizer) and (
        "@compiler.compile()" in inspect.getsource(muon)
    )


def _is_pipeline(engine) -> bool:
    return hasattr(engine, "train_batch") and hasattr(engine.module, "forward_funcs")


def _is_dualpipev(engine) -> bool:
    from deepspeed.pipe import DualPipeVModule  # lazy: see the package docstring

    return isinstance(engine.module, DualPipeVModule)


def _is_interleaved(engine) -> bool:
    return type(engine).__name__ == "InterleavedEngine"  # keel/engine/interleaved_engine.py


# what Keel's interleaved 1F1B (keel/engine/interleaved_engine.py) overrides or relies on in DeepSpeed's DualPipeV
# classes
DUALPIPEV_MACHINERY = (
    "_phase",
    "_first_send",
    "_recv_specs",
    "_queue_p2p",
    "_downstream_stage",
    "_upstream_stage",
    "_is_loss_stage",
    "_is_last_rank",
    "_loss_stage_global_rank",
    "_INSTRUCTION_MAP",
)
DUALPIPEV_MODULE_MACHINERY = (
    "phase_bounds",
    "phase_funcs",
    "phase_checkpointable",
    "activate_phase",
    "_set_bounds",
)


def _plain_fp32(engine) -> bool:
    return (
        engine.zero_optimization_stage() == 0
        and not engine.fp16_enabled()
        and not engine.bfloat16_enabled()
    )


def fp16_scale_holder(engine):
    optimizer = engine.optimizer
    return getattr(optimizer, "loss_scale_config", optimizer)


INTERNALS = [
    Internal(
        "optimizer.optimizer",
        "a public accessor for the torch optimizer inside ZeRO/bf16/fp16 wrappers",
        wraps_optimizer,
        lambda e: isinstance(getattr(e.optimizer, "optimizer", None), torch.optim.Optimizer),
    ),
    Internal(
        "optimizer._global_grad_norm",
        "the step's global grad norm before the update (engine."
        "get_global_grad_norm() is set only after it)",
        wraps_optimizer,
        lambda e: hasattr(e.optimizer, "_global_grad_norm"),
    ),
    Internal(
        "optimizer.overflow",
        "a way to veto one optimizer step (DeepSpeed reads this flag after step())",
        lambda e: True,
        lambda e: "overflow" in type(e)._take_model_step.__code__.co_names,
    ),
    Internal(
        "engine._take_model_step",
        "a hook between gradient reduction and the update",
        lambda e: True,
        lambda e: callable(getattr(e, "_take_model_step", None)),
    ),
    Internal(
        "engine.clip_fp32_gradients",
        "a clipping hook for the fp32 ZeRO-0 path",
        _plain_fp32,
        lambda e: "clip_fp32_gradients" in type(e)._take_model_step.__code__.co_names,
    ),
    Internal(
        "optimizer.cur_scale / loss_scale_config.cur_scale",
        "the current dynamic loss scale",
        lambda e: e.fp16_enabled(),
        lambda e: hasattr(fp16_scale_holder(e), "cur_scale"),
    ),
    Internal(
        "PipelineEngine.total_loss",
        "the last stage's summed micro-batch losses inside train_batch",
        _is_pipeline,
        lambda e: hasattr(e, "total_loss"),
    ),
    Internal(
        "PipelineModule._layer_specs / _local_start (DualPipeVModule: phase_bounds / phase_funcs)",
        "a rank's stages of the layer list",
        _is_pipeline,
        lambda e: (
            hasattr(e.module, "_layer_specs")
            and (
                all(hasattr(e.module, a) for a in ("phase_bounds", "phase_funcs"))
                if _is_dualpipev(e)
                else hasattr(e.module, "_local_start")
            )
        ),
    ),
    Internal(
        f"DualPipeVEngine {', '.join(DUALPIPEV_MACHINERY)}; DualPipeVModule "
        f"{', '.join(DUALPIPEV_MODULE_MACHINERY)}",
        "an engine and a module that run more than two stages per rank (interleaved 1F1B)",
        _is_interleaved,
        lambda e: (
            all(hasattr(e, a) for a in DUALPIPEV_MACHINERY)
            and all(hasattr(e.module, a) for a in DUALPIPEV_MODULE_MACHINERY)
        ),
    ),
    Internal(
        "deepspeed.utils.groups._EXPERT_PARALLEL_GROUP (+ _RANKS, _EXPERT_DATA_PARALLEL_GROUP, _RANKS) and "
        "_clone_world_group",
        "registering caller-built expert groups",
        lambda e: True,
        lambda e: expert_group_tables() is not None,
    ),
    Internal(
        "deepspeed.comm.comm.cdb.new_group",
        "giving DeepSpeed's pipeline grid and world group caller-built process groups",
        lambda e: True,
        lambda e: serves_new_group(),
    ),
    Internal(
        "deepspeed.utils.groups.mpu",
        "resetting the groups a finished run handed DeepSpeed",
        lambda e: True,
        lambda e: _has_path(groups_module(), "mpu"),
    ),
    Internal(
        "param.ds_tensor",
        "this rank's ZeRO-3 partition without a gather",
        lambda e: e.zero_optimization_stage() == 3,
        lambda e: any(hasattr(p, "ds_tensor") for p in e.module.parameters()),
    ),
    Internal(
        "param._hp_mapping (hp_fragment, lp_fragment, optim_fragment)",
        "this rank's fp32 partition and optimizer "
        "state of one parameter under ZeRO-1/2 and bf16 (safe_get_local_fp32_param is ZeRO-3 only)",
        lambda e: wraps_optimizer(e) and e.zero_optimization_stage() < 3,
        lambda e: any(
            all(
                hasattr(getattr(p, "_hp_mapping", None), a)
                for a in ("hp_fragment", "lp_fragment", "optim_fragment")
            )
            for p in e.module.parameters()
        ),
    ),
    Internal(
        "param.ds_pipe_replicated",
        "which parameters are pipeline replicas",
        _is_pipeline,
        lambda e: any(
            "ds_pipe_replicated" in inspect.getsource(cls)
            for cls in type(e.module).__mro__
            if cls.__module__.startswith("deepspeed.")
        ),
    ),
    Internal(
        "engine.checkpoint_engine.save",
        "a hook on each file save_checkpoint writes",
        lambda e: True,
        lambda e: callable(getattr(getattr(e, "checkpoint_engine", None), "save", None)),
    ),
    Internal(
        "runtime.zero.utils.is_zero_supported_optimizer imports Muon",
        "a lazy deepspeed.runtime.compiler.compile",
        lambda e: True,
        lambda e: _muon_imported_by_the_zero_check(),
    ),
    Internal(
        "engine.checkpoint_engine.makedirs",
        "a hook on each directory save_checkpoint makes",
        lambda e: True,
        lambda e: callable(getattr(getattr(e, "checkpoint_engine", None), "makedirs", None)),
    ),
    Internal(
        "engine._copy_recovery_script",
        "a hook on the recovery scripts save_checkpoint copies",
        lambda e: True,
        lambda e: callable(getattr(e, "_copy_recovery_script", None)),
    ),
    Internal(
        "runtime.engine.clone_tensors_for_torch_save",
        "a say in where save_checkpoint's host copies go",
        lambda e: True,
        lambda e: len(clone_sites()) == 2,
    ),
    Internal(
        "engine._get_zero_param_shapes, _optimizer_has_ckpt_event_prologue/epilogue; ZeRO optimizer "
        "load_state_dict(state_dict_list, load_from_fp32_weights, param_shapes)",
        "a per-rank state dict of the engine (in-memory checkpoints)",
        lambda e: True,
        lambda e: (
            all(
                callable(getattr(e, name, None))
                for name in (
                    "_get_zero_param_shapes",
                    "_optimizer_has_ckpt_event_prologue",
                    "_optimizer_has_ckpt_event_epilogue",
                )
            )
            and (
                not e.zero_optimization()
                or {"state_dict_list", "load_from_fp32_weights", "param_shapes"}
                <= set(inspect.signature(e.optimizer.load_state_dict).parameters)
            )
        ),
    ),
    Internal(
        "accelerator.is_fp16_supported",
        "an fp16 override for the CPU accelerator",
        lambda e: True,
        lambda e: _has_path(accelerator(), "is_fp16_supported"),
    ),
]


def check_engine(engine) -> None:
    """Raise one line naming the first internal this engine needs that the installed DeepSpeed lacks."""
    import deepspeed  # lazy: see the package docstring

    for internal in INTERNALS:
        if internal.applies(engine) and not internal.probe(engine):
            raise DeepSpeedInternalsError(
                f"DeepSpeed {deepspeed.__version__} has no `{internal.name}`, which Keel uses for want of "
                f"{internal.missing_api}; install a DeepSpeed in the range setup.py pins"
            )


def groups_module():
    from deepspeed.utils import groups  # lazy: see the package docstring

    return groups


def comm_backend():
    """DeepSpeed's communication backend object (`deepspeed.comm.comm.cdb`, a TorchBackend), None before
    `deepspeed.init_distributed`."""
    from deepspeed.comm import comm as ds_comm  # lazy: see the package docstring

    return ds_comm.cdb


def serves_new_group() -> bool:
    """`deepspeed.comm.new_group` asks `cdb.new_group`, which an instance attribute can answer."""
    from deepspeed.comm import comm as ds_comm  # lazy: see the package docstring

    return hasattr(ds_comm, "cdb") and "cdb.new_group(" in inspect.getsource(ds_comm.new_group)


def clone_sites() -> list:
    """The modules whose save paths call `clone_tensors_for_torch_save` by their own global name (the engine's
    model, optimizer and expert files; the pipeline module's layer files)."""
    from deepspeed.runtime import engine  # lazy: see the package docstring
    from deepspeed.runtime.pipe import module

    return [m for m in (engine, module) if hasattr(m, "clone_tensors_for_torch_save")]


# ds_to_universal's parallel phases (`_do_parallel_work` calls) on each of its paths: extract, then merge
UNIVERSAL_PHASES = 2


def universal_converter():
    """DeepSpeed's `ds_to_universal` module, checked for what `convert_to_universal` relies on: `main(args)`,
    `parse_arguments()`, and every parallel phase going through `_do_parallel_work` — two on each path (ZeRO-1/2:
    extract, merge tp slices; ZeRO-3: extract, merge tp or zero3 slices), so the lead alone goes on after the
    second."""
    from deepspeed.checkpoint import ds_to_universal  # lazy: see the package docstring

    source = inspect.getsource(ds_to_universal)
    callers = {
        "_extract_zero_shard_files",
        "_extract_zero_shard_files_stage3",
        "_merge_tp_slice_files",
        "_merge_zero3_slice_files",
    }
    if not (
        all(hasattr(ds_to_universal, n) for n in ("main", "parse_arguments", *callers))
        and source.count("_do_parallel_work(") == 1 + len(callers)
        and all(
            "_do_parallel_work(" in inspect.getsource(getattr(ds_to_universal, n)) for n in callers
        )
    ):
        import deepspeed

        raise DeepSpeedInternalsError(
            f"DeepSpeed {deepspeed.__version__}'s ds_to_universal no longer runs its phases through "
            "_do_parallel_work, which Keel uses for want of a way to spread the conversion over hosts; "
            "install a DeepSpeed in the range setup.py pins"
        )
    return ds_to_universal


def expert_group_tables():
    groups = groups_module()
    names = (
        "_EXPERT_PARALLEL_GROUP",
        "_EXPERT_PARALLEL_GROUP_RANKS",
        "_EXPERT_DATA_PARALLEL_GROUP",
        "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
        "_clone_world_group",
    )
    return groups if all(hasattr(groups, n) for n in names) else None


def accelerator():
    from deepspeed.accelerator import get_accelerator  # lazy: see the package docstring

    return get_accelerator()
