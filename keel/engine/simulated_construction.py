"""One rank's construction in a simulated world (keel/engine/simulated_world.py).

`construct` builds the Topology, this rank's layers on the meta device, and DeepSpeed's engine as
far as it can be built (the record's notes say where it stopped), each under its own phase of the
world's `WorldRecord`; `small_config` gives a model any grid divides.
"""

from __future__ import annotations

import contextlib
import io
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from keel.adapters.deepspeed_internals import serve_group_requests
from keel.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from keel.engine.memory_model import Layout, estimate, layer_list, rank_layer_indices
from keel.engine.simulated_world import DEEPSPEED, MODEL, TOPOLOGY, SimulatedWorld
from keel.model.materialize import Placement
from keel.parallel.layer_parallel import LayerParallel
from keel.parallel.topology import GridShape, Topology


class MetaPlacement(Placement):
    """Build layers on the meta device and leave them there: shapes and attributes, no storage."""

    def __init__(self) -> None:
        super().__init__("meta")

    def build(self, construct: Callable[[], Any]) -> Any:
        with torch.device("meta"):
            return construct()

    def fill(self, param: nn.Parameter, write: Callable[..., None]) -> None:
        """Nothing to fill: drawing a real model's initial values only to drop them costs seconds a rank."""


# DeepSpeed config for the simulated engine: ds_configs/zero1.json, Keel's default
ZERO1 = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 1_000_000,
    "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000_000},
}


def small_config(shape: GridShape) -> RunConfig:
    """A small model the grid divides (heads by tp, 2 blocks per pipeline stage, 2 experts per ep
    rank when ep > 1): group and collective counts do not depend on the model's size, and bytes only
    through its number of tensors."""
    moe = {"moe_experts": 2 * shape.ep} if shape.ep > 1 else {}
    heads = max(8, shape.tp)
    return RunConfig(
        model=ModelConfig(
            vocab_size=1024,
            dim=8 * heads,
            n_layers=2 * shape.pp,
            n_heads=heads,
            n_kv_heads=heads,
            **moe,
        ),
        parallel=ParallelConfig(tp=shape.tp, pp=shape.pp, ep=shape.ep, sp=shape.sp, cp=shape.cp),
        train=TrainConfig(global_batch_size=shape.dp, micro_batch_size=1),
    )


@dataclass
class Built:
    """One rank's construction: its Topology, its pipeline stage's layers (on meta) and DeepSpeed's
    engine, if it could be built."""

    topology: Topology
    layers: list[nn.Module]
    engine: Any = None


def construct(
    world: SimulatedWorld,
    shape: GridShape,
    cfg: RunConfig,
    engine: str = "meta",
    ds: dict[str, Any] | None = None,
) -> Built:
    """Build rank `world.rank`'s Topology, layers and DeepSpeed engine in `world`, each a phase.

    `engine`: "meta" hands DeepSpeed the model on the meta device (no parameter memory); "cpu"
    materializes it (the small model of `small_config` takes kilobytes), which lets DeepSpeed's
    whole initialize run on the fake backend; "none" skips it. Where DeepSpeed stops,
    `world.record.notes["deepspeed"]` says where and why; what it created until then is counted.
    """
    with world.phase(TOPOLOGY):
        topology = Topology(
            shape, world.rank, cfg.parallel.pipeline_schedule, cfg.parallel.virtual_stages
        )
    with world.phase(MODEL):
        parallel = LayerParallel.from_topology(
            topology, cfg.parallel.sequence_parallel, seed=cfg.train.seed
        )
        layers = stage_layers(cfg, parallel, topology)
        world.record.parameters = sum(p.numel() for p in unique_parameters(layers))
        # what the memory model predicts for this layout, with the async save the simulation drives
        layout = Layout(
            tp=shape.tp, pp=shape.pp, dp=shape.dp, ep=shape.ep, sp=shape.sp, cp=shape.cp
        )
        saving = replace(cfg, checkpoint=replace(cfg.checkpoint, async_save=True))
        world.record.memory = estimate(saving, ds or ZERO1, layout)
    built = Built(topology, layers)
    if engine != "none":
        with world.phase(DEEPSPEED):
            built.engine = _deepspeed_engine(world, cfg, topology, parallel, engine, ds or ZERO1)
    return built


def stage_layers(cfg: RunConfig, parallel: LayerParallel, topology: Topology) -> list[nn.Module]:
    """This rank's layers of the flat list, on meta, cut into stages as DeepSpeed cuts them (the
    memory model's path: keel/engine/memory_model.py)."""
    p = cfg.parallel
    layers = layer_list(cfg.model, parallel, p.pp)
    counts = [sum(q.numel() for q in layer.parameters()) for layer in layers]
    held = rank_layer_indices(
        layers, counts, p.pp, p.pipeline_partition, p.pipeline_schedule, p.virtual_stages
    )
    return [layers[i] for i in held[topology.rank_in("pp")]]


def unique_parameters(layers: list[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for layer in layers:
        for param in layer.parameters():
            seen.setdefault(id(param), param)
    return list(seen.values())


def _deepspeed_engine(
    world: SimulatedWorld,
    cfg: RunConfig,
    topology: Topology,
    parallel: LayerParallel,
    engine: str,
    ds: dict[str, Any],
) -> Any:
    from keel.engine.build import build_engine
    from keel.engine.pipeline import build_pipeline
    from keel.model import CausalLM

    placement = MetaPlacement() if engine == "meta" else Placement()
    try:
        # rank 0 prints the whole pipeline grid; DeepSpeed's group requests get Keel's groups (build.py)
        with (
            contextlib.redirect_stdout(io.StringIO()),
            serve_group_requests(topology.process_groups.get),
        ):
            if cfg.parallel.pp > 1:
                model = build_pipeline(cfg, topology, parallel, placement)
            else:
                model = CausalLM(
                    cfg.model, seed=cfg.train.seed, parallel=parallel, placement=placement
                )
            built = build_engine(cfg, ds, topology, model=model)
    # where DeepSpeed stops without real tensors is a finding, not a failure
    except Exception as err:
        world.record.notes[DEEPSPEED] = (
            f"stopped at {_deepest_dependency_frame(err)}: "
            f"{type(err).__name__}: {str(err).split(';')[0].splitlines()[0][:100]}"
        )
        return None
    world.record.notes[DEEPSPEED] = f"built {type(built).__name__}"
    return built


def _deepest_dependency_frame(err: BaseException) -> str:
    """The innermost deepspeed/ (else keel/) frame of `err`'s traceback: file:line (function)."""
    frames = traceback.extract_tb(err.__traceback__)
    for marker in ("deepspeed" + os.sep, "keel" + os.sep):
        inside = [f for f in frames if marker in f.filename]
        if inside:
            f = inside[-1]
            return f"{marker}{f.filename.rsplit(marker, 1)[1]}:{f.lineno} ({f.name})"
    return "?"
