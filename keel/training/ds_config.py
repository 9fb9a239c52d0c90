"""The DeepSpeed JSON config: loaded as the user wrote it, "auto" values filled from the run config.

Keel does not re-implement DeepSpeed's config. It only fills the values that must agree with the run (batch
sizes, clipping, optimizer hyper-parameters) and refuses combinations that would silently disagree with it.
The filled dict is what `deepspeed.initialize` receives and what DeepSpeed's own parser checks.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from keel.config import ConfigError, RunConfig, validate_batch_split
from keel.config.validate import compile_setting

AUTO = "auto"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
OPTIMIZER_TYPES = ("adam", "adamw")


def load_ds_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"train.ds_config: DeepSpeed config {path} does not exist; pass --ds-config or fix the path")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"train.ds_config: {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"train.ds_config: {path} must hold a JSON object")
    return data


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def precision(ds: dict[str, Any]) -> str:
    fp16 = ds.get("fp16", {}).get("enabled", False)
    bf16 = ds.get("bf16", ds.get("bfloat16", {})).get("enabled", False)
    if fp16 and bf16:
        raise ConfigError("ds_config: fp16.enabled and bf16.enabled are both true; enable at most one")
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
    Ulysses sp ranks (keel/parallel/pipeline.py), which all read the same sample, so it counts it on each."""
    return cfg.parallel.sp if cfg.parallel.pp > 1 else 1


def _fill(ds: dict[str, Any], key: str, value: Any, source: str) -> None:
    given = ds.get(key, AUTO)
    if given == AUTO:
        ds[key] = value
    elif given != value:
        raise ConfigError(f'ds_config.{key}={given} disagrees with {source}={value}; set it to "auto" or {value}')


def resolve_ds_config(raw: dict[str, Any], cfg: RunConfig, dp_size: int) -> dict[str, Any]:
    """Return a copy of `raw` with every "auto" filled and every value checked against the run config."""
    ds = copy.deepcopy(raw)
    if "scheduler" in ds:
        raise ConfigError(
            "ds_config.scheduler: Keel owns the LR schedule (train.lr_schedule, train.warmup_steps, "
            "train.min_lr_ratio); remove the scheduler section"
        )
    stage = zero_stage(ds)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"ds_config.zero_optimization.stage={stage}: must be 0, 1, 2 or 3")
    if precision(ds) == "fp16" and stage == 0:
        raise ConfigError(
            "ds_config: fp16 with zero_optimization.stage 0 mis-scales gradients in DeepSpeed 0.19 (its ZeRO-0 fp16 "
            "optimizer unscales a loss that was never scaled); use stage >= 1 (ds_configs/fp16.json) or bf16"
        )
    if stage == 3 and compile_setting(cfg.model.compile) == "true":
        raise ConfigError("ds_config.zero_optimization.stage=3 with model.compile: ZeRO-3 gathers parameters in "
                          "hooks inside each block, which a compiled block does not keep; use ZeRO 0-2 or "
                          "model.compile=false")
    if stage == 3 and cfg.model.moe_experts:
        raise ConfigError("ds_config.zero_optimization.stage=3 with model.moe_experts: DeepSpeed partitions MoE "
                          "parameters at ZeRO stage 1 or 2 only; use ds_configs/zero1.json or zero2.json")
    ga = gradient_accumulation(cfg, dp_size)
    _fill(ds, "train_batch_size", cfg.train.global_batch_size, "train.global_batch_size")
    _fill(ds, "train_micro_batch_size_per_gpu", cfg.train.micro_batch_size, "train.micro_batch_size")
    _fill(ds, "gradient_accumulation_steps", ga, "train.global_batch_size/(micro_batch_size×dp)")
    _fill(ds, "gradient_clipping", cfg.train.grad_clip, "train.grad_clip")
    ds["train_batch_size"] *= engine_batch_copies(cfg)  # checked against Keel's global batch above
    if cfg.parallel.pp > 1 and cfg.parallel.tp > 1 and cfg.parallel.sequence_parallel:
        # DeepSpeed splits stage-to-stage activations across the TP group assuming every TP rank holds the same
        # tensor; under sequence parallelism each holds a different sequence shard, so each must send its own.
        pipe = ds.setdefault("pipeline", {})
        for key in ("pipe_partitioned", "grad_partitioned"):
            if pipe.get(key, False) is not False:
                raise ConfigError(f"ds_config.pipeline.{key} must be false with parallel.sequence_parallel")
            pipe[key] = False
    if "optimizer" in ds:
        opt = ds["optimizer"]
        kind = str(opt.get("type", "")).lower()
        if kind not in OPTIMIZER_TYPES:
            raise ConfigError(f"ds_config.optimizer.type={opt.get('type')!r}: Keel supports Adam/AdamW")
        params = opt.setdefault("params", {})
        for key, value, source in (
            ("lr", cfg.train.lr, "train.lr"),
            ("betas", list(cfg.train.betas), "train.betas"),
            ("eps", cfg.train.eps, "train.eps"),
            ("weight_decay", cfg.train.weight_decay, "train.weight_decay"),
        ):
            given = params.get(key, AUTO)
            if given == AUTO:
                params[key] = value
            elif given != value:
                raise ConfigError(
                    f'ds_config.optimizer.params.{key}={given} disagrees with {source}={value}; set it to "auto"'
                )
    return ds
