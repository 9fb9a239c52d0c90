"""Before launch: every pipeline rank must hold the same optimizer parameter groups.

DeepSpeed's ZeRO optimizer computes the gradient norm group by group, one all-reduce over the pipeline ranks each.
A rank holding only an embedding or a head has one group (decayed matrices, no norms or biases), runs fewer
all-reduces than its peers, and the step hangs in the first one it misses. Measured: a pp=2 DualPipeV run whose
`parameters` partition left rank 0 only the embedding and the tied head hung in its first step.

Checked on the real layer classes built on meta (nothing is allocated), cut as DeepSpeed will cut them once
`model.vocab_size` is known (the `parameters` partition weighs the embedding by it).
"""

from __future__ import annotations

from keel.config import ConfigError, RunConfig
from keel.engine.memory_model import layer_list, rank_layer_indices
from keel.model.param_groups import layer_groups_of
from keel.parallel.layer_parallel import LayerParallel


def check_pipeline_plan(cfg: RunConfig, zero_stage: int) -> None:
    """Raise ConfigError (one line naming the field to change) for a layout DeepSpeed would fail or hang on."""
    parallel = cfg.parallel
    if parallel.pp == 1 or zero_stage == 0:
        return  # no pipeline, or no ZeRO optimizer: Keel's own clipping sums one norm over all groups at once
    layers = layer_list(
        cfg.model, LayerParallel.without_groups(tp=parallel.tp, ep=parallel.ep), parallel.pp
    )
    counts = [sum(q.numel() for q in layer.parameters()) for layer in layers]
    held = rank_layer_indices(
        layers,
        counts,
        parallel.pp,
        parallel.pipeline_partition,
        parallel.pipeline_schedule,
        parallel.virtual_stages,
    )
    wanted = layer_groups_of(layers)
    for rank, indices in enumerate(held):
        groups = layer_groups_of([layers[i] for i in indices])
        if groups != wanted:
            names = ", ".join(type(layers[i]).__name__ for i in indices) or "no layers"
            fix = (
                "parallel.pipeline_partition=type:Block (or fewer pipeline stages)"
                if parallel.pipeline_partition != "type:Block"
                else f"fewer pipeline stages (parallel.pp={parallel.pp}) or more blocks "
                f"(model.n_layers={cfg.model.n_layers})"
            )
            raise ConfigError(
                f"parallel.pipeline_partition={parallel.pipeline_partition}: pipeline rank {rank} would hold only "
                f"{names}, without {' and '.join(sorted(wanted - groups))} parameters, and DeepSpeed's ZeRO "
                f"optimizer hangs when pipeline ranks hold different parameter groups; use {fix}"
            )
