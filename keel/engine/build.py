"""Model + optimizer + LR schedule handed to `deepspeed.initialize`.

DeepSpeed owns ZeRO, mixed precision, loss scaling, gradient accumulation and clipping; Keel hands it the
model, the parameter groups (no weight decay on norms and biases), the optimizer unless the JSON config names
one, and an LR schedule that is a pure function of the step.
"""

from __future__ import annotations

import logging
from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

from keel.adapters.deepspeed_internals import (
    allow_fp16_on_cpu,
    check_engine,
    import_muon_compiling_on_first_use,
    replace_fp32_clipping,
    serve_group_requests,
)
from keel.adapters.torch_internals import check_torch
from keel.adapters.torchao_internals import check_torchao
from keel.config import RunConfig
from keel.engine.compile_policy import should_compile
from keel.engine.ds_config import averages_sequence_ranks, precision, resolve_ds_config, zero_stage
from keel.engine.interleaved_engine import as_interleaved
from keel.engine.lr_schedule import build_scheduler
from keel.engine.pipeline import build_pipeline, local_layers
from keel.engine.zero3_init import ZeRO3Placement
from keel.model import CausalLM, compile_blocks, weight_decay_groups
from keel.model.hf_init import load_hf_weights
from keel.model.materialize import Placement
from keel.model.precision import fp8_line
from keel.parallel.grad_norm import clip_grad_norm_, global_grad_norm
from keel.parallel.layer_parallel import LayerParallel
from keel.parallel.topology import Topology

log = logging.getLogger("keel")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def placement_for(ds: dict[str, Any] | None, topology: Topology | None) -> Placement:
    """Where the model is materialized: on the engine's device in its dtype (ZeRO-3: under `zero.Init`), so
    DeepSpeed never copies or casts a whole model; fp32 on the CPU when there is no engine config."""
    if ds is None:
        return Placement()
    dtype = DTYPES[precision(ds)]
    if zero_stage(ds) == 3:
        return ZeRO3Placement(ds, topology or Topology.from_env(), dtype)
    return Placement(get_accelerator().current_device_name(), dtype)


def build_model(
    cfg: RunConfig,
    topology: Topology | None = None,
    ds: dict[str, Any] | None = None,
    document_eos: int | None = None,
) -> torch.nn.Module:
    """The plain `CausalLM`, or this rank's pipeline stage when parallel.pp > 1, built for the resolved
    DeepSpeed config `ds` (see `placement_for`); `document_eos`: data.document_mask's EOS id."""
    parallel = LayerParallel.from_topology(
        topology, cfg.parallel.sequence_parallel, seed=cfg.train.seed
    )
    placement = placement_for(ds, topology)
    if cfg.model.fp8 != "off":
        check_torchao()  # one line naming what is missing, before any layer casts
        log.info(fp8_line(cfg.model, parallel.tp.size))
    if cfg.parallel.pp > 1:
        module = build_pipeline(cfg, topology, parallel, placement)
        if cfg.model.init_from:
            _load_init_from(cfg, local_layers(module), placement)
        return module
    model = CausalLM(
        cfg.model,
        seed=cfg.train.seed,
        parallel=parallel,
        label_smoothing=cfg.train.label_smoothing,
        z_loss=cfg.train.z_loss,
        checkpoint_interval=cfg.train.activation_checkpoint_interval,
        placement=placement,
        document_eos=document_eos,
        engine_averages_sp=averages_sequence_ranks(cfg, ds or {}),
    )
    if cfg.model.init_from:
        _load_init_from(cfg, list(enumerate(model.layers)), placement)
    compiled, why = should_compile(cfg, zero_stage(ds or {}), precision(ds or {}))
    if compiled:
        compile_blocks(model.layers)
    log.info(why)
    return model


def _load_init_from(cfg: RunConfig, layers: list, placement: Placement) -> None:
    """model.init_from: this rank's parameters from the HF directory, after init and before the engine exists."""
    load_hf_weights(layers, cfg.model, placement)
    log.info("model.init_from: weights loaded from %s", cfg.model.init_from)


class LRScale:
    """A run-time LR factor the schedule multiplies in (the spike guard halves it on a rollback)."""

    def __init__(self, value: float = 1.0):
        self.value = value

    def get(self) -> float:
        return self.value


class Fp32GradClipper:
    """Plain fp32 ZeRO-0: clip by Keel's model-parallel-aware norm and record it (DeepSpeed's own clipping on
    this path neither records the norm nor sums it over pipeline stages). Other engines report their norm."""

    def __init__(self, engine, topology: Topology):
        self.norm: torch.Tensor | None = None  # a device scalar, read back by the trainer
        self.active = (
            engine.zero_optimization_stage() == 0
            and not engine.fp16_enabled()
            and not engine.bfloat16_enabled()
        )
        if not self.active:
            return
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self.topology = topology
        self.max_norm = engine.gradient_clipping()
        if self.max_norm > 0:
            replace_fp32_clipping(engine, self.clip)

    def clip(self) -> torch.Tensor:
        self.norm = clip_grad_norm_(self.params, self.max_norm, self.topology)
        return self.norm

    def measure(self) -> torch.Tensor:
        """The norm without clipping (when clipping is off, DeepSpeed never calls `clip`)."""
        self.norm = global_grad_norm(self.params, self.topology)
        return self.norm


def adamw_implementation() -> dict[str, bool]:
    """torch AdamW's fused kernel (one pass per parameter, every update term in registers) on CUDA and on the CPU;
    torch itself defaults to `foreach` on CUDA and the per-parameter loop elsewhere. On this project's 2-core CPU
    the fused step takes 4-5 ms for 5M parameters against 17 ms for the loop and 20 ms for `foreach`."""
    return {"fused": True}


def build_engine(
    cfg: RunConfig,
    ds_raw: dict[str, Any],
    topology: Topology,
    model: torch.nn.Module | None = None,
    lr_scale: LRScale | None = None,
    document_eos: int | None = None,
):
    """Return the DeepSpeed engine for this rank; `ds_raw` is the user's JSON with "auto" values unfilled."""
    ds = resolve_ds_config(ds_raw, cfg, topology.dp_size)
    if precision(ds) == "fp16" and allow_fp16_on_cpu():
        log.warning(
            "fp16 on CPU: overriding DeepSpeed's CPU accelerator fp16 check (slow; use bf16 on CPU)"
        )
    # DeepSpeed's own group requests (pipeline grid, world group) get Keel's groups
    with serve_group_requests(topology.process_groups.get):
        model = model if model is not None else build_model(cfg, topology, ds, document_eos)
        groups = weight_decay_groups(model, cfg.train.weight_decay)
        # expert params in groups of their own, which ZeRO partitions over edp only
        if cfg.model.moe_experts:
            groups = split_params_into_different_moe_groups_for_optimizer(groups)
        optimizer = None
        if "optimizer" not in ds:
            optimizer = torch.optim.AdamW(
                groups,
                lr=cfg.train.lr,
                betas=tuple(cfg.train.betas),
                eps=cfg.train.eps,
                weight_decay=cfg.train.weight_decay,
                **adamw_implementation(),
            )
        import_muon_compiling_on_first_use()  # a second of start-up per ZeRO rank otherwise
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=groups,
            optimizer=optimizer,
            lr_scheduler=lambda opt: build_scheduler(
                opt, cfg.train, dp=topology.dp_size, extra_scale=(lr_scale or LRScale()).get
            ),
            config=ds,
            # the pipeline engine asks for its groups from the PipelineModule's topology (same grid order as
            # ours): serve_group_requests answers with ours
            mpu=topology if topology.shape.world_size > 1 and cfg.parallel.pp == 1 else None,
        )
    if cfg.parallel.pp > 1 and cfg.parallel.pipeline_schedule == "interleaved":
        # initialize has no engine-class hook
        engine = as_interleaved(engine, cfg.parallel.virtual_stages)
    check_engine(engine)  # an upgrade that removed an internal Keel needs fails here, naming it
    check_torch()
    return engine


def document_eos(cfg, data: dict) -> int | None:
    """The EOS id document masking splits windows at (data.json records the tokenizer's), or None when off."""
    if not cfg.data.document_mask:
        return None
    if "eos_id" not in data:
        raise RuntimeError(
            "data.document_mask: this run's data.json records no eos_id; re-run `keel train` from "
            "the command line to rewrite it"
        )
    return int(data["eos_id"])
