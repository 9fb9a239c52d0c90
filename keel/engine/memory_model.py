"""Per-rank memory of a run before it starts: parameters, gradients, optimizer state and communication buckets.

The ZeRO paper's accounting (Rajbhandari et al. 2020, §3): with Ψ parameters on a rank (its tp / pp-stage / ep
share, counted from a meta-device build of the real layers, which costs nothing), parameters take Ψ·b and
gradients Ψ·b bytes (b = 4 in fp32, 2 in bf16/fp16), and Adam keeps K·Ψ: two fp32 moments (8 bytes), plus an fp32
master copy (4) when the parameters are 16-bit — and under any ZeRO stage, whose DeepSpeed optimizers always
keep their own fp32 partition apart from the module's parameters. ZeRO-1 divides the optimizer state by the ranks
that replicate the parameters, ZeRO-2 the gradients too, ZeRO-3 the parameters too: the data-parallel ranks and,
within each, the ranks that split one sequence (context-parallel cp × Ulysses sp: DeepSpeed's
sequence-data-parallel group, Keel's `sp_dp`). Expert parameters are partitioned over the expert-data-parallel
group (dp / ep × cp × sp, Keel's `expert_dp`) instead. Buckets are the configured sizes, each capped by the number
of elements it could ever hold: ZeRO-1/2's reduce bucket, ZeRO-3's reduce and prefetch buckets plus the
largest parameter it gathers whole, and the flat buffer a prefetch bucket is all-gathered into — DeepSpeed copies
each parameter out of it (`AllGatherCoalescedHandle.wait`) and the buffer lives until the bucket's last parameter
is fetched. `keel preflight` and bench/memory.py read it.

Beside the steady state, what the rare paths add, so a rank sized to its shard stays within it there too:
- `transient` (device): the largest short-lived buffer — NaN localization's one unpartitioned gradient at a time
  (the largest parameter's; keel/training/guards/localize.py), the MoE grouped GEMM's stacked weights of one
  layer's local experts, made in forward and again in backward, never kept (keel/model/moe.py), or the
  context-parallel ring's K/V and dK/dV in flight in one block's attention (keel/engine/activations.py
  `ring_bytes`); none of them is alive while another is;
- `host`: an asynchronous checkpoint's snapshot, one host copy of the files this rank writes (its optimizer
  partition, and on the rank writing its stage's model states, the stage's weights; async_save.py);
- `snapshots` (host memory, as tmpfs pages): checkpoint.memory_interval's in-memory snapshots, this rank's whole
  state (its module's weights — none under ZeRO-3, where the optimizer's fp32 partition is their copy — and its
  optimizer partition) twice between snapshots — its own and the copy it holds of its buddy's — and four times at
  the peak, while one is taken: the previous own one stays until every rank's new one is whole, the previous
  copy until the new one has arrived (keel/training/checkpoint/memory.py).
The sample order holds nothing per sample (a Feistel permutation computed per index, keel/data/samples.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from keel.config import ModelConfig, RunConfig
from keel.engine.activations import ActivationShape, in_flight, rank_activation_bytes, ring_bytes
from keel.engine.ds_config import precision, zero_stage
from keel.model.llama import Block, EmbeddingLayer, FinalNorm, OutputLayer
from keel.model.router import is_moe_block
from keel.parallel.layer_parallel import LayerParallel

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# DeepSpeed's defaults for the bucket knobs a JSON may leave out (deepspeed/runtime/zero/config.py, 0.19)
DS_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
}


@dataclass(frozen=True)
class Layout:
    """Parallel sizes: tensor, pipeline, data (the whole data-parallel size, world / (tp·pp·cp·sp), ep carved out
    of it), expert, Ulysses and context parallel."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    sp: int = 1
    cp: int = 1

    @property
    def zero_group(self) -> int:
        """The ranks ZeRO partitions the dense parameters' state over: data × context × Ulysses parallel (the
        cp and sp ranks of a replica replicate the parameters)."""
        return self.dp * self.cp * self.sp

    @property
    def expert_group(self) -> int:
        """The ranks holding the same experts, over which their state is partitioned."""
        return max(1, self.dp // self.ep) * self.cp * self.sp


@dataclass(frozen=True)
class ParamShare:
    """One rank's parameters (its tp shard of its pipeline stage's layers, its experts), in elements."""

    dense: int
    expert: int
    largest: int  # the largest single parameter, elements
    expert_layer: int = 0  # the most expert elements one layer holds on this rank

    @property
    def total(self) -> int:
        return self.dense + self.expert


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes on one rank (the largest pipeline stage's) for one layout, stage and precision."""

    share: ParamShare
    precision: str
    stage: int
    params: int
    grads: int
    optimizer: int
    buckets: int
    # device: the largest short-lived buffer, of a rare path or the cp ring's (module docstring)
    transient: int = 0
    host: int = 0  # host: an asynchronous checkpoint's snapshot of this rank's files (0 when saves are sync)
    # host (tmpfs): in-memory snapshots at their peak (module docstring); 0 when off
    snapshots: int = 0
    # device: the activations of the micro-batches in flight at the rank's peak (keel/engine/activations.py)
    activations: int = 0
    # more than one micro-batch a step: the gradients of the earlier ones live through the later forwards
    accumulates: bool = True

    @property
    def total(self) -> int:
        """The steady state on the device: what every step holds."""
        return self.params + self.grads + self.optimizer + self.buckets

    @property
    def working(self) -> int:
        """The steady state and the activations at their peak together. With one micro-batch a step (common at
        scale: a large data-parallel world, micro-batch 1) backward makes the gradients as it frees the
        activations, and they never peak together: the larger of the two, plus one layer's worth of the other
        (bounded by the largest parameter's gradient)."""
        if self.accumulates:
            return self.total + self.activations
        layer = BYTES[self.precision] * self.share.largest
        return (
            self.params + self.optimizer + self.buckets + max(self.grads, self.activations) + layer
        )

    @property
    def peak(self) -> int:
        """The working set plus the largest transient buffer."""
        return self.working + self.transient


def layer_list(cfg: ModelConfig, parallel: LayerParallel, pp: int) -> list[torch.nn.Module]:
    """The layer list a pipeline lays out (a tied head is a second embedding on the last stage); on meta."""

    def construct() -> list[torch.nn.Module]:
        first = EmbeddingLayer(cfg, parallel)
        blocks = [Block(cfg, i, parallel) for i in range(cfg.n_layers)]
        if cfg.tie_embeddings:
            head = (
                EmbeddingLayer(cfg, parallel)
                if pp > 1
                else OutputLayer(cfg, first.tok_embeddings, parallel)
            )
        else:
            head = OutputLayer(cfg, None, parallel)
        return [first, *blocks, FinalNorm(cfg, parallel), head]

    with torch.device("meta"):
        return construct()


def stage_parts(
    counts: list[int], layers: list[torch.nn.Module], pp: int, method: str
) -> list[int]:
    """Stage boundaries exactly as DeepSpeed's PipelineModule draws them for `pipeline_partition`."""
    # DeepSpeed imports in ~1.5 s and logs a notice to stdout on CPU; `keel` checks every config through this
    # module before launch (keel/engine/pipeline_plan.py), and only a pipeline needs DeepSpeed's partitioner
    from deepspeed.runtime import utils as ds_utils

    if pp == 1:
        return [0, len(layers)]
    if method == "uniform":
        return ds_utils.partition_uniform(num_items=len(layers), num_parts=pp)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if pattern.search(type(layer).__name__) else 0 for layer in layers]
        return ds_utils.partition_balanced(weights=weights, num_parts=pp)
    return ds_utils.partition_balanced(weights=counts, num_parts=pp)


def rank_stages(pp: int, schedule: str = "1f1b", chunks: int = 2) -> list[tuple[int, ...]]:
    """The pipeline stages each pipeline rank runs: one each under 1F1B; under DualPipeV the layer list is cut
    into 2·pp stages and rank r runs stage r and stage 2·pp − 1 − r (DeepSpeed's `DualPipeVModule`); interleaved
    cuts `chunks`·pp and rank r runs stages r, r + pp, … (Keel's `InterleavedModule`)."""
    if schedule == "dualpipev":
        return [(r, 2 * pp - 1 - r) for r in range(pp)]
    if schedule == "interleaved":
        return [tuple(c * pp + r for c in range(chunks)) for r in range(pp)]
    return [(r,) for r in range(pp)]


def rank_layer_indices(
    layers: list[torch.nn.Module],
    counts: list[int],
    pp: int,
    method: str,
    schedule: str = "1f1b",
    chunks: int = 2,
) -> list[list[int]]:
    """The indices into the flat layer list each pipeline rank holds, cut as DeepSpeed cuts them."""
    stages = rank_stages(pp, schedule, chunks)
    parts = stage_parts(counts, layers, sum(len(s) for s in stages), method)
    return [[i for s in ranks for i in range(parts[s], parts[s + 1])] for ranks in stages]


@dataclass(frozen=True)
class LayerCut:
    """The layer list on meta, each layer's parameters (a tied tensor counted once: dense, expert, largest) and the
    indices each pipeline rank holds, cut as DeepSpeed cuts them: what every estimate of one model at one tp, ep,
    pp and schedule shares (`keel plan` makes it once for many layouts)."""

    layers: list[torch.nn.Module]
    per_layer: list[tuple[int, int, int]]
    held: list[list[int]]


def layer_cut(
    cfg: ModelConfig,
    layout: Layout,
    method: str = "parameters",
    schedule: str = "1f1b",
    chunks: int = 2,
) -> LayerCut:
    layers = layer_list(cfg, LayerParallel.without_groups(tp=layout.tp, ep=layout.ep), layout.pp)
    per_layer = []
    seen: set[int] = set()
    for layer in layers:
        dense = expert = largest = 0
        for param in layer.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            largest = max(largest, param.numel())
            if hasattr(param, "expert_id"):
                expert += param.numel()
            else:
                dense += param.numel()
        per_layer.append((dense, expert, largest))
    held = rank_layer_indices(
        layers, [d + e for d, e, _ in per_layer], layout.pp, method, schedule, chunks
    )
    return LayerCut(layers, per_layer, held)


def run_cut(cfg: RunConfig, layout: Layout) -> LayerCut:
    """`layer_cut` for a run: its model, partition method and pipeline schedule."""
    parallel = cfg.parallel
    return layer_cut(
        cfg.model,
        layout,
        parallel.pipeline_partition,
        parallel.pipeline_schedule,
        parallel.virtual_stages,
    )


def param_share(
    cfg: ModelConfig,
    layout: Layout,
    method: str = "parameters",
    stage: int | None = None,
    schedule: str = "1f1b",
    chunks: int = 2,
    cut: LayerCut | None = None,
) -> ParamShare:
    """A rank's parameters at `layout` on pipeline rank `stage` (default: the largest), counted from the real
    layer classes built on meta; `method` is `parallel.pipeline_partition`, `schedule` `parallel.pipeline_schedule`
    (a DualPipeV rank holds two stages, and the tied head is the embedding itself). `cut`: `layer_cut`'s answer
    for these arguments, made before."""
    cut = cut or layer_cut(cfg, layout, method, schedule, chunks)
    per_layer = list(cut.per_layer)
    if schedule == "dualpipev" and cfg.tie_embeddings and layout.pp > 1:
        per_layer[-1] = (
            0,
            0,
            0,
        )  # DeepSpeed counts the tied head when cutting; on rank 0 it is the embedding
    ranks = [[per_layer[i] for i in indices] for indices in cut.held]
    best = (
        ranks[stage] if stage is not None else max(ranks, key=lambda s: sum(d + e for d, e, _ in s))
    )
    return ParamShare(
        sum(d for d, _, _ in best),
        sum(e for _, e, _ in best),
        max(m for _, _, m in best),
        max(e for _, e, _ in best),
    )


def estimate(
    cfg: RunConfig,
    ds: dict[str, Any],
    layout: Layout,
    cut: LayerCut | None = None,
) -> RankMemory:
    """Per-rank bytes for `cfg`'s model under the DeepSpeed JSON `ds` (precision, ZeRO stage, buckets);
    `cut` as `param_share` takes it."""
    parallel = cfg.parallel
    cut = cut or run_cut(cfg, layout)
    share = param_share(
        cfg.model,
        layout,
        parallel.pipeline_partition,
        schedule=parallel.pipeline_schedule,
        chunks=parallel.virtual_stages,
        cut=cut,
    )
    prec, stage = precision(ds), zero_stage(ds)
    b = BYTES[prec]
    zero = {**DS_DEFAULTS, **ds.get("zero_optimization", {})}

    def split(bytes_per_element: int, partitioned: bool) -> int:
        if not partitioned:
            return bytes_per_element * share.total
        return bytes_per_element * (
            math.ceil(share.dense / layout.zero_group)
            + math.ceil(share.expert / layout.expert_group)
        )

    master = 4 if (prec != "fp32" or stage >= 1) else 0
    params = split(b, stage >= 3)
    grads = split(b, stage >= 2)
    optimizer = split(8 + master, stage >= 1)
    if stage in (1, 2):
        buckets = b * min(int(zero["reduce_bucket_size"]), share.total)
    elif stage == 3:
        gathered = min(
            int(zero["stage3_prefetch_bucket_size"]) + share.largest,
            int(zero["stage3_max_live_parameters"]),
            share.total,
        )
        # the flat buffer a prefetch bucket is gathered into, alive while its parameters are copied out
        flat = min(int(zero["stage3_prefetch_bucket_size"]), share.total)
        buckets = b * (min(int(zero["reduce_bucket_size"]), share.total) + gathered + flat)
    else:
        buckets = 0
    # one unpartitioned gradient (localization); one layer's local experts stacked (grouped GEMM); the cp ring's
    transient = max(
        b * max(share.largest, share.expert_layer),
        ring_bytes(cfg.model, activation_shape(cfg, layout, prec)),
    )
    # the model-states file holds the stage's weights (one data-parallel rank writes it; ZeRO-3: each its part)
    host = (
        (params if stage >= 3 else b * share.total) + optimizer if cfg.checkpoint.async_save else 0
    )
    # checkpoint.memory_interval: the rank's own state and its buddy's (module weights + optimizer partition),
    # each twice while a snapshot is in flight
    snapshot = (0 if stage >= 3 else b * share.total) + optimizer
    snapshots = 4 * snapshot if cfg.checkpoint.memory_interval else 0
    activations = activation_peak(cfg, layout, prec, cut)
    return RankMemory(
        share,
        prec,
        stage,
        params,
        grads,
        optimizer,
        buckets,
        transient,
        host,
        snapshots,
        activations,
        accumulates=_micro_batches(cfg, layout) > 1,
    )


def activation_shape(cfg: RunConfig, layout: Layout, prec: str) -> ActivationShape:
    """What decides a block's activations on one rank of `layout` (keel/engine/activations.py)."""
    return ActivationShape(
        cfg.train.micro_batch_size,
        cfg.data.seq_len,
        prec,
        tp=layout.tp,
        sp=layout.sp,
        sequence_parallel=cfg.parallel.sequence_parallel,
        cp=layout.cp,
        document_mask=cfg.data.document_mask,
    )


def _micro_batches(cfg: RunConfig, layout: Layout) -> int:
    """Micro-batches per step on a data-parallel rank (at least one: a bench may ask of an uneven split)."""
    return max(1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * layout.dp))


def activation_peak(cfg: RunConfig, layout: Layout, prec: str, cut: LayerCut | None = None) -> int:
    """The largest activation peak over the pipeline ranks (keel/engine/activations.py): each rank's blocks and
    head, cut as DeepSpeed cuts the layer list, times the micro-batches its schedule holds in flight."""
    parallel = cfg.parallel
    cut = cut or run_cut(cfg, layout)
    layers, held = cut.layers, cut.held
    micro_batches = _micro_batches(cfg, layout)
    shape = activation_shape(cfg, layout, prec)
    head = layers[-1]
    vocab_shard = next(head.parameters()).shape[0]
    peak = 0
    for rank, indices in enumerate(held):
        blocks = [
            (layers[i].layer_id, is_moe_block(cfg.model, layers[i].layer_id))
            for i in indices
            if isinstance(layers[i], Block)
        ]
        flight = in_flight(
            parallel.pipeline_schedule, layout.pp, micro_batches, rank, parallel.virtual_stages
        )
        has_head = len(layers) - 1 in indices
        peak = max(peak, rank_activation_bytes(cfg, shape, blocks, has_head, flight, vocab_shard))
    return peak
