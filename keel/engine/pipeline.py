"""Pipeline parallelism: Keel's layer list as DeepSpeed `PipelineModule` layer specs.

DeepSpeed owns the schedule (`parallel.pipeline_schedule`: 1F1B's `PipelineModule`; `DualPipeVModule`, which
cuts 2·pp stages and gives rank r stages r and 2·pp−1−r; or, for Megatron's interleaved 1F1B, Keel's
`InterleavedModule` on DualPipeV's machinery, which cuts v·pp and gives rank r stages r, r+pp, …), the p2p
transfers and the tied-weight synchronisation;
Keel supplies the same layer classes the plain model uses, with tensor-parallel shards inside each stage, and
initialises every stage's layers exactly as the single-process model would (init is keyed by the layer's index
in the full list, so a stage needs nothing from the others).

With tied embeddings the last stage holds a second `EmbeddingLayer` whose `project` is the head; DeepSpeed's
`TiedLayerSpec` broadcasts it from the first stage at start and sums the two copies' gradients every step. Under
DualPipeV both stages are on rank 0 and share one module: one tensor, nothing to sum.

Ulysses sequence and context parallelism inside the stages: DeepSpeed's pipeline topology has pipe, data and
model axes only, so the sp and cp ranks are folded into its data axis (Keel's grid orders edp, ep, cp, sp inside
pp, so its data axis is exactly Keel's `sp_dp` group, the one ZeRO partitions over in the plain engine too).
Stage-to-stage activations are each rank's own tokens [b, s/(cp·sp), d]; the loss takes the full-sequence mean
and lets the engine's average over its data axis combine the sequence ranks' gradients (`engine_averages_sp`),
and the engine's batch arithmetic counts every such rank's copy of a sample (`keel/engine/ds_config.py`
`engine_batch_copies`).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.utils.checkpoint
from deepspeed.pipe import DualPipeVModule, LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from keel.adapters.deepspeed_internals import pipeline_layer_specs, pipeline_local_chunks
from keel.config import RunConfig
from keel.engine.interleaved_engine import InterleavedModule
from keel.model import (
    Block,
    EmbeddingLayer,
    FinalNorm,
    OutputLayer,
    RotaryEmbedding,
    VocabParallelLoss,
    init_weights,
)
from keel.model.materialize import Placement
from keel.parallel import comm
from keel.parallel.layer_parallel import NO_PARALLEL, LayerParallel
from keel.parallel.topology import Topology

log = logging.getLogger("keel")
TIED_KEY = "embedding"


def _project(module: EmbeddingLayer, x: torch.Tensor) -> torch.Tensor:
    return module.project(x)


def _placed(spec_class: type) -> type:
    """A `spec_class` (LayerSpec or TiedLayerSpec) whose `build` constructs the layer on meta and materializes it
    where `placement` says (uninitialised, like an eager build: DeepSpeed also builds every layer once just to
    count its parameters, so init happens in `build_pipeline`, for this stage's layers only)."""

    class Placed(spec_class):
        def __init__(self, placement: Placement, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.placement = placement

        def build(self, log: bool = False) -> torch.nn.Module:
            return self.placement.build(lambda: spec_class.build(self, log))

    Placed.__name__ = Placed.__qualname__ = f"Placed{spec_class.__name__}"
    return Placed


def layer_specs(
    cfg: RunConfig, parallel: LayerParallel = NO_PARALLEL, placement: Placement | None = None
) -> list:
    """The flat layer list as specs: `[Embedding, Block × n, FinalNorm, Head]`, built lazily per stage."""
    model = cfg.model
    placement = placement or Placement()
    spec, tied = _placed(LayerSpec), _placed(TiedLayerSpec)
    if model.tie_embeddings:
        weight = ["tok_embeddings.weight"]
        first = tied(placement, TIED_KEY, EmbeddingLayer, model, parallel, tied_weight_attr=weight)
        head = tied(
            placement,
            TIED_KEY,
            EmbeddingLayer,
            model,
            parallel,
            forward_fn=_project,
            tied_weight_attr=weight,
        )
    else:
        first = spec(placement, EmbeddingLayer, model, parallel)
        head = spec(placement, OutputLayer, model, None, parallel)
    rotary = RotaryEmbedding(
        model.head_dim, model.rope_theta
    )  # shared by the blocks a stage builds
    blocks = [
        spec(placement, Block, model, layer_id, parallel, rotary)
        for layer_id in range(model.n_layers)
    ]
    return [first, *blocks, spec(placement, FinalNorm, model, parallel), head]


def local_layers(module) -> list[tuple[int, torch.nn.Module]]:
    """(index in the full list, module) for every layer this rank holds, tied copies included, stage by stage
    (DualPipeV: two stages per rank, and a layer tied between them appears once)."""
    specs = pipeline_layer_specs(module)
    layers, seen = [], set()
    for first, funcs in pipeline_local_chunks(module):
        for offset, func in enumerate(funcs):
            index = first + offset
            spec = specs[index]
            layer = module.tied_modules[spec.key] if isinstance(spec, TiedLayerSpec) else func
            if id(layer) not in seen:
                seen.add(id(layer))
                layers.append((index, layer))
    return layers


def build_pipeline(
    cfg: RunConfig, topology: Topology, parallel: LayerParallel, placement: Placement | None = None
):
    """A `PipelineModule` over this rank's stage (DualPipeV: its two stages; interleaved: its v chunks), initialised
    as the single-process model would be; `parallel`: this rank's layer contexts, from the same `topology`."""
    shape = topology.shape
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    schedule = cfg.parallel.pipeline_schedule
    if schedule == "interleaved":
        module_class = functools.partial(InterleavedModule, chunks=cfg.parallel.virtual_stages)
    else:
        module_class = DualPipeVModule if schedule == "dualpipev" else PipelineModule
    module = module_class(
        layers=layer_specs(cfg, parallel, placement),
        # sp and cp folded into DeepSpeed's data axis (see the module docstring)
        topology=PipeModelDataParallelTopology(
            num_pp=shape.pp, num_mp=shape.tp, num_dp=shape.dp * shape.cp * shape.sp
        ),
        loss_fn=VocabParallelLoss(
            cfg.model,
            parallel,
            cfg.train.label_smoothing,
            cfg.train.z_loss,
            engine_averages_sp=True,
        ),
        partition_method=cfg.parallel.pipeline_partition,
        activation_checkpoint_interval=cfg.train.activation_checkpoint_interval,
        activation_checkpoint_func=checkpoint,
    )
    placement = placement or Placement()
    for index, layer in local_layers(module):
        init_weights([layer], cfg.model, cfg.train.seed, first_index=index, placement=placement)
    describe_stages(module, topology, cfg.parallel.pipeline_partition)
    return module


def describe_stages(module, topology: Topology, method: str) -> None:
    """Print each rank's stages (layers and parameter count) from rank 0 (the partition users tune)."""
    specs = pipeline_layer_specs(module)
    chunks = []
    for first, funcs in pipeline_local_chunks(module):
        names = [specs[first + offset].typename.__name__ for offset in range(len(funcs))]
        chunks.append(f"layers {first}-{first + len(funcs) - 1} ({_compact(names)})")
    params = sum(p.numel() for p in module.parameters())
    summary = f"{' + '.join(chunks)} {params / 1e6:.2f}M params"
    gathered = comm.all_gather_object(summary, topology.control("pp"))
    if topology.rank == 0:
        log.info(
            "pipeline partition (%s): %s",
            method,
            " | ".join(f"rank {i}: {s}" for i, s in enumerate(gathered)),
        )


def _compact(names: list[str]) -> str:
    out: list[str] = []
    for name in names:
        if out and out[-1].split("×")[0] == name:
            count = int(out[-1].split("×")[1]) if "×" in out[-1] else 1
            out[-1] = f"{name}×{count + 1}"
        else:
            out.append(name)
    return ", ".join(out)
