"""The DeepSpeed JSON config: loaded as the user wrote it, "auto" values filled from the run config.

Keel does not re-implement DeepSpeed's config. It only fills the values that must agree with the run (batch
sizes, clipping, optimizer hyper-parameters) and refuses combinations that would silently disagree with it.
The filled dict is what `deepspeed.initialize` receives and what DeepSpeed's own parser checks.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
from collections.abc import KeysView
from pathlib import Path
from typing import Any

from keel.config import ConfigError, RunConfig, validate_batch_split
from keel.config.rules import compile_setting

AUTO = "auto"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
OPTIMIZER_TYPES = ("adam", "adamw")
# top-level keys whose value DeepSpeed reads as an object (a list or a string there is a TypeError inside it)
OBJECT_KEYS = (
    "zero_optimization",
    "fp16",
    "bf16",
    "bfloat16",
    "optimizer",
    "scheduler",
    "pipeline",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "flops_profiler",
    "activation_checkpointing",
    "aio",
    "autotuning",
    "elasticity",
    "checkpoint",
    "data_types",
    "compile",
    "amp",
    "timers",
    "torch_autocast",
)
# read by DeepSpeedConfig only in its process-group branch, which a parse before launch does not take
READ_WITH_A_PROCESS_GROUP = ("sequence_parallel_size",)


def load_ds_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"train.ds_config: DeepSpeed config {path} does not exist; pass --ds-config or fix the path"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"train.ds_config: {path} is not valid JSON (line {exc.lineno}: {exc.msg})"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"train.ds_config: {path} must hold a JSON object")
    return data


def check_shape(ds: dict[str, Any]) -> None:
    """Each section Keel or DeepSpeed reads as an object is one."""
    for key in OBJECT_KEYS:
        if key in ds and not isinstance(ds[key], dict):
            raise ConfigError(f"ds_config.{key}: expected a JSON object, got {json.dumps(ds[key])}")


def _section(ds: dict[str, Any], key: str) -> dict[str, Any]:
    check_shape({key: ds.get(key, {})})
    return ds.get(key, {})


def zero_stage(ds: dict[str, Any]) -> int:
    stage = _section(ds, "zero_optimization").get("stage", 0)
    if isinstance(stage, bool) or stage not in (
        0,
        1,
        2,
        3,
    ):  # not "1" or 1.5, which int() would read
        raise ConfigError(
            f"ds_config.zero_optimization.stage={json.dumps(stage)}: must be 0, 1, 2 or 3"
        )
    return int(stage)


def _enabled(ds: dict[str, Any], key: str) -> bool:
    """`<key>.enabled` as JSON true/false: "false" is truthy to Python and false to DeepSpeed's parser."""
    value = _section(ds, key).get("enabled", False)
    if not isinstance(value, bool):
        raise ConfigError(f"ds_config.{key}.enabled={json.dumps(value)}: expected true or false")
    return value


def precision(ds: dict[str, Any]) -> str:
    fp16 = _enabled(ds, "fp16")
    bf16_old = _enabled(ds, "bfloat16")  # DeepSpeed's older name, read when "bf16" is absent
    bf16 = _enabled(ds, "bf16") if "bf16" in ds else bf16_old
    if fp16 and bf16:
        raise ConfigError(
            "ds_config: fp16.enabled and bf16.enabled are both true; enable at most one"
        )
    return "fp16" if fp16 else "bf16" if bf16 else "fp32"


def gradient_accumulation(cfg: RunConfig, dp_size: int) -> int:
    """Micro-batches per optimizer step on each data-parallel rank, so the global batch stays fixed.

    `dp_size` is the one the ranks have, which after a resize on resume is not the one `validate` saw: so the
    config's batch-split rule runs again here for it.
    """
    validate_batch_split(cfg.train, dp_size)
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp_size)


def engine_batch_copies(cfg: RunConfig) -> int:
    """How many times DeepSpeed counts one sample of the global batch: the pipeline engine's data axis holds the
    Ulysses sp and context-parallel cp ranks (keel/engine/pipeline.py), which all read the same sample, so it
    counts it on each."""
    return cfg.parallel.sp * cfg.parallel.cp if cfg.parallel.pp > 1 else 1


def averages_sequence_ranks(cfg: RunConfig, ds: dict[str, Any]) -> bool:
    """Whether the engine averages gradients over the ranks splitting a sequence (cp × sp) rather than summing
    them, which the loss's sequence mean must then undo (keel/parallel/ulysses.py). The pipeline engine averages
    over its data axis, which holds them; ZeRO-3's reduce-scatter (its default path) averages over the whole
    sequence-data-parallel group, where ZeRO 0-2 and ZeRO-3's all-reduce path divide by dp alone. Measured: cp2
    under ZeRO-3 had half the one-process gradient norm before this."""
    zero = _section(ds, "zero_optimization")
    return cfg.parallel.pp > 1 or (
        zero.get("stage", 0) == 3 and zero.get("reduce_scatter", True) is not False
    )


def _agrees(given: Any, value: Any) -> bool:
    """`given` is the value itself (true is not the number 1)."""
    return not isinstance(given, bool) and given == value


def _fill(ds: dict[str, Any], key: str, value: Any, source: str) -> None:
    given = ds.get(key, AUTO)
    if given == AUTO:
        ds[key] = value
    elif not _agrees(given, value):
        raise ConfigError(
            f'ds_config.{key}={given} disagrees with {source}={value}; set it to "auto" or {value}'
        )


def resolve_ds_config(raw: dict[str, Any], cfg: RunConfig, dp_size: int) -> dict[str, Any]:
    """Return a copy of `raw` with every "auto" filled and every value checked against the run config."""
    ds = copy.deepcopy(raw)
    check_shape(ds)
    if "scheduler" in ds:
        raise ConfigError(
            "ds_config.scheduler: Keel owns the LR schedule (train.lr_schedule, train.warmup_steps, "
            "train.min_lr_ratio); remove the scheduler section"
        )
    stage = zero_stage(ds)
    if precision(ds) == "fp16" and stage == 0:
        raise ConfigError(
            "ds_config: fp16 with zero_optimization.stage 0 mis-scales gradients in DeepSpeed 0.19 (its ZeRO-0 fp16 "
            "optimizer unscales a loss that was never scaled); use stage >= 1 (ds_configs/fp16.json) or bf16"
        )
    if stage == 3 and compile_setting(cfg.model.compile) == "true":
        raise ConfigError(
            "ds_config.zero_optimization.stage=3 with model.compile: ZeRO-3 gathers parameters in "
            "hooks inside each block, which a compiled block does not keep; use ZeRO 0-2 or "
            "model.compile=false"
        )
    if stage == 3 and cfg.model.moe_experts:
        raise ConfigError(
            "ds_config.zero_optimization.stage=3 with model.moe_experts: DeepSpeed partitions MoE "
            "parameters at ZeRO stage 1 or 2 only; use ds_configs/zero1.json or zero2.json"
        )
    ga = gradient_accumulation(cfg, dp_size)
    _fill(ds, "train_batch_size", cfg.train.global_batch_size, "train.global_batch_size")
    _fill(
        ds, "train_micro_batch_size_per_gpu", cfg.train.micro_batch_size, "train.micro_batch_size"
    )
    _fill(ds, "gradient_accumulation_steps", ga, "train.global_batch_size/(micro_batch_size×dp)")
    _fill(ds, "gradient_clipping", cfg.train.grad_clip, "train.grad_clip")
    ds["train_batch_size"] *= engine_batch_copies(cfg)  # checked against Keel's global batch above
    parallel = cfg.parallel
    if (
        parallel.pp > 1
        and parallel.tp > 1
        and (parallel.sequence_parallel or parallel.pipeline_schedule != "1f1b")
    ):
        # DeepSpeed splits stage-to-stage activations across the TP group assuming every TP rank holds the same
        # tensor; under sequence parallelism each holds a different sequence shard, so each must send its own.
        # DualPipeV's engine (which also runs interleaved 1F1B) does not split them at all (it asserts both off).
        why = (
            "parallel.sequence_parallel"
            if parallel.sequence_parallel
            else f"parallel.pipeline_schedule={parallel.pipeline_schedule}"
        )
        pipe = ds.setdefault("pipeline", {})
        for key in ("pipe_partitioned", "grad_partitioned"):
            if pipe.get(key, False) is not False:
                raise ConfigError(f"ds_config.pipeline.{key} must be false with {why}")
            pipe[key] = False
    if "optimizer" in ds:
        opt = ds["optimizer"]
        kind = str(opt.get("type", "")).lower()
        if kind not in OPTIMIZER_TYPES:
            raise ConfigError(
                f"ds_config.optimizer.type={opt.get('type')!r}: Keel supports Adam/AdamW"
            )
        params = opt.setdefault("params", {})
        if not isinstance(params, dict):
            raise ConfigError(
                f"ds_config.optimizer.params: expected a JSON object, got {json.dumps(params)}"
            )
        for key, value, source in (
            ("lr", cfg.train.lr, "train.lr"),
            ("betas", list(cfg.train.betas), "train.betas"),
            ("eps", cfg.train.eps, "train.eps"),
            ("weight_decay", cfg.train.weight_decay, "train.weight_decay"),
        ):
            given = params.get(key, AUTO)
            if given == AUTO:
                params[key] = value
            elif not _agrees(given, value):
                raise ConfigError(
                    f'ds_config.optimizer.params.{key}={given} disagrees with {source}={value}; set it to "auto"'
                )
    return ds


class _ReadKeys(dict):
    """A dict that records which keys were asked for (get, [], in, keys())."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def keys(self) -> KeysView:  # `key in d.keys()` goes through __contains__
        return KeysView(self)


def check_engine_layout(cfg: RunConfig, ds_raw: dict[str, Any], world_size: int) -> None:
    """The DeepSpeed JSON with this layout, before any rank starts (a config `validate` already passed): the
    pipeline engine's ZeRO limit, then DeepSpeed's own parser on the resolved config. `keel train` and `keel plan`
    (every layout it proposes) ask the same."""
    stage = zero_stage(ds_raw)
    if cfg.parallel.pp > 1 and stage >= 2:
        raise ConfigError(
            f"parallel.pp={cfg.parallel.pp} with ZeRO stage {stage}: DeepSpeed's pipeline engine "
            "supports ZeRO 0 and 1 only; use ds_configs/zero1.json or parallel.pp=1"
        )
    dp = world_size // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.sp * cfg.parallel.cp)
    check_with_deepspeed(resolve_ds_config(ds_raw, cfg, dp))


def check_with_deepspeed(ds: dict[str, Any]) -> None:
    """DeepSpeed's own parser on the resolved config, before any rank starts: a value or nested key it refuses
    (a string where it wants a number, a typo inside zero_optimization) is one line here instead of a traceback on
    every rank after start-up. A top-level key it never reads is ignored by DeepSpeed; one an edit away from a key
    it reads (zero_optimisation) is a typo, refused here."""
    parsed = _ReadKeys(copy.deepcopy(ds))
    # with no process group DeepSpeed takes a world of 1: give it one data-parallel rank's share of the batch,
    # whose split over the ranks resolve_ds_config has checked
    parsed["train_batch_size"] = (
        ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    )
    try:
        _deepspeed_config_class()(parsed)
    # its parser raises ValueError, AssertionError, pydantic's ValidationError ...
    except Exception as exc:
        raise ConfigError(
            f"train.ds_config: DeepSpeed refuses it: {type(exc).__name__}: {exc}"
        ) from None
    known = sorted(str(k) for k in parsed.read | set(READ_WITH_A_PROCESS_GROUP))
    for key in ds:
        close = [] if key in known else difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        if close:
            raise ConfigError(
                f"ds_config.{key}: not a key DeepSpeed reads, so it would be ignored; "
                f"did you mean {close[0]}?"
            )


def _deepspeed_config_class() -> type:
    """DeepSpeedConfig, imported with the notice DeepSpeed logs on stdout when it finds no GPU ("Setting accelerator
    to CPU") held back: the pre-launch check runs in commands whose stdout is their output (keel slurm --dry-run
    prints the sbatch script)."""
    # DeepSpeed's logger (deepspeed.utils.logging), created at its import
    notices = logging.getLogger("DeepSpeed")

    def hold(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")

    notices.addFilter(hold)
    try:
        # here, to hold back the notice (docstring)
        from deepspeed.runtime.config import (
            DeepSpeedConfig,
        )
    finally:
        notices.removeFilter(hold)
    return DeepSpeedConfig
