"""Pipeline layouts refused before launch, with one line naming what to change (no ranks start)."""

from __future__ import annotations

import pytest

from keel.config import ConfigError, RunConfig, validate
from keel.engine.memory_model import Layout, layer_list, param_share, rank_layer_indices
from keel.engine.pipeline_plan import check_pipeline_plan
from keel.model.llama import CausalLM, num_params
from keel.parallel.layer_parallel import LayerParallel


def tiny(
    pp: int = 2, schedule: str = "dualpipev", partition: str = "type:Block", vocab: int = 512
) -> RunConfig:
    cfg = RunConfig()
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab_size = 32, 2, 4, 2, vocab
    cfg.parallel.pp, cfg.parallel.pipeline_schedule, cfg.parallel.pipeline_partition = (
        pp,
        schedule,
        partition,
    )
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, 8
    return cfg


@pytest.mark.fault(
    "pipeline cut that would hang ZeRO's norm", "refused before launch with the partition to use"
)
def test_a_rank_without_norms_is_refused_under_zero():
    """The measured hang: DualPipeV's `parameters` cut gives rank 0 the embedding and the tied head only."""
    with pytest.raises(
        ConfigError,
        match=r"pipeline_partition=parameters: pipeline rank 0 would hold only "
        r"EmbeddingLayer, EmbeddingLayer, without no_decay .*=type:Block",
    ):
        check_pipeline_plan(tiny(partition="parameters"), zero_stage=1)
    # Keel's own clipping: one norm, no hang
    check_pipeline_plan(tiny(partition="parameters"), zero_stage=0)
    check_pipeline_plan(tiny(), zero_stage=1)


def test_1f1b_is_checked_too():
    """A stage's share no larger than the table makes the `parameters` cut give a 1F1B stage the embedding or the
    head alone (Llama-3-8B cut into 16 stages: a 0.53B-entry table, 0.5B per stage; refused as computed here)."""
    with pytest.raises(
        ConfigError, match="pipeline rank 0 would hold only EmbeddingLayer, without no_decay"
    ):
        check_pipeline_plan(
            tiny(pp=4, schedule="1f1b", partition="parameters", vocab=32000), zero_stage=1
        )
    blocks = tiny(pp=4, schedule="1f1b", vocab=32000)
    with pytest.raises(
        ConfigError,
        match=r"rank 2 would hold only FinalNorm, .* use fewer pipeline stages "
        r"\(parallel.pp=4\) or more blocks \(model.n_layers=2\)",
    ):
        check_pipeline_plan(blocks, zero_stage=1)  # type:Block has 2 blocks for 4 stages
    blocks.model.n_layers = 4
    check_pipeline_plan(blocks, zero_stage=1)


def test_dualpipev_cuts_two_stages_per_rank_as_deepspeed_does():
    cfg = tiny(partition="parameters")
    layers = layer_list(cfg.model, LayerParallel.without_groups(), 2)
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    # what DeepSpeed's DualPipeVModule printed for this model: stages [0], [1], [2, 3], [4]
    assert rank_layer_indices(layers, counts, 2, "parameters", "dualpipev") == [[0, 4], [1, 2, 3]]
    assert rank_layer_indices(layers, counts, 2, "type:Block", "1f1b") == [[0, 1], [2, 3, 4]]


def test_interleaved_cuts_v_stages_per_rank_as_deepspeed_does():
    cfg = tiny(partition="type:Block")
    layers = layer_list(cfg.model, LayerParallel.without_groups(), 2)
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    # what Keel's InterleavedModule printed for this model: stages [0, 1], [2], [3], [4]; rank r holds r and r+2
    assert rank_layer_indices(layers, counts, 2, "type:Block", "interleaved", 2) == [
        [0, 1, 3],
        [2, 4],
    ]


@pytest.mark.parametrize("tied", [True, False])
def test_interleaved_shares_add_up_to_the_model(tied):
    """As under 1F1B, the tied head is a replica of the embedding on the last rank (counted there too)."""
    cfg = tiny()
    cfg.model.tie_embeddings = tied
    whole = num_params(CausalLM(cfg.model))
    shares = [
        param_share(
            cfg.model, Layout(pp=2), "type:Block", stage=r, schedule="interleaved", chunks=2
        ).total
        for r in range(2)
    ]
    assert sum(shares) == whole + (cfg.model.vocab_size * cfg.model.dim if tied else 0)


@pytest.mark.parametrize("tied", [True, False])
def test_dualpipev_shares_add_up_to_the_model(tied):
    cfg = tiny()
    cfg.model.tie_embeddings = tied
    whole = num_params(CausalLM(cfg.model))
    shares = [
        param_share(cfg.model, Layout(pp=2), "type:Block", stage=r, schedule="dualpipev").total
        for r in range(2)
    ]
    assert sum(shares) == whole


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(pp=1), "pipeline_schedule=dualpipev needs parallel.pp >= 2"),
        (dict(batch=4), r"needs at least 2×pp = 4 micro-batches .* a batch of 4 gives 2"),
        (dict(moe=4), "MoE runs in pipeline stages under 1f1b only"),
    ],
)
def test_dualpipev_refusals(change, message):
    cfg = tiny(pp=change.get("pp", 2))
    cfg.train.global_batch_size = change.get("batch", 8)
    cfg.model.moe_experts = change.get("moe", 0)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=cfg.parallel.pp)
