"""The memory model: its parameter counts are the real model's, and its ZeRO stages divide what the paper says."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from keel.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from keel.engine.memory_model import Layout, estimate, param_share
from keel.launcher.local import free_port
from keel.model import CausalLM
from keel.parallel.layer_parallel import LayerParallel
from tests.spawned import start_world

MODEL = dict(vocab_size=200, dim=64, n_layers=3, n_heads=8, n_kv_heads=2, vocab_pad_multiple=16)


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_share_is_the_real_models_at_tp(tp, tie):
    cfg = ModelConfig(**MODEL, tie_embeddings=tie)
    share = param_share(cfg, Layout(tp=tp))
    for rank in range(tp):
        model = CausalLM(cfg, parallel=LayerParallel.without_groups(tp=tp, tp_rank=rank))
        assert _count(model) == share.total
        assert max(p.numel() for p in model.parameters()) == share.largest


def test_share_counts_this_ranks_experts():
    cfg = ModelConfig(**MODEL, moe_experts=4, moe_every=1)
    share = param_share(cfg, Layout(ep=2, dp=2))
    model = CausalLM(cfg, parallel=LayerParallel.without_groups(ep=2, ep_rank=1))
    assert _count(model) == share.total
    assert share.expert == sum(p.numel() for p in model.parameters() if hasattr(p, "expert_id")) > 0


def _ds(stage: int, precision: str = "fp32") -> dict:
    ds = {
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 1000,
            "stage3_prefetch_bucket_size": 500,
        }
    }
    if precision != "fp32":
        ds[precision] = {"enabled": True}
    return ds


def test_zero_stages_partition_what_the_paper_says():
    cfg = RunConfig(model=ModelConfig(**MODEL))
    layout = Layout(dp=4)
    n = param_share(cfg.model, layout).total
    z0, z1, z2, z3 = (estimate(cfg, _ds(stage), layout) for stage in range(4))
    assert (z0.params, z0.grads, z0.optimizer, z0.buckets) == (
        4 * n,
        4 * n,
        8 * n,
        0,
    )  # fp32 Adam: 2 moments
    # ZeRO optimizers keep an fp32 partition of their own (K = 12), divided over dp from stage 1
    assert (z1.params, z1.grads, z1.optimizer) == (4 * n, 4 * n, 12 * -(-n // 4))
    assert (z2.params, z2.grads, z2.optimizer) == (4 * n, 4 * -(-n // 4), z1.optimizer)
    assert (z3.params, z3.grads, z3.optimizer) == (4 * -(-n // 4), z2.grads, z1.optimizer)
    assert z1.buckets == z2.buckets == 4 * 1000
    assert z3.buckets == 4 * (1000 + 500 + param_share(cfg.model, layout).largest)
    bf16 = estimate(cfg, _ds(0, "bf16"), layout)
    assert (bf16.params, bf16.grads, bf16.optimizer) == (
        2 * n,
        2 * n,
        12 * n,
    )  # master + moments, as in the paper


def test_the_rare_paths_transient_and_the_async_snapshot():
    """NaN localization's one unpartitioned gradient, the grouped GEMM's one layer of stacked local experts, and
    an asynchronous save's host copy of the rank's files."""
    from keel.config import CheckpointConfig

    dense = RunConfig(model=ModelConfig(**MODEL))
    layout = Layout(dp=4)
    share = param_share(dense.model, layout)
    z1 = estimate(dense, _ds(1, "bf16"), layout)
    assert z1.transient == 2 * share.largest and z1.peak == z1.total + z1.activations + z1.transient
    assert z1.host == 0  # synchronous saves write from the live state
    saving = RunConfig(model=ModelConfig(**MODEL), checkpoint=CheckpointConfig(async_save=True))
    # its optimizer partition (fp32 master and moments), and the stage's weights it may write
    assert estimate(saving, _ds(1, "bf16"), layout).host == 2 * share.total + 12 * -(
        -share.total // 4
    )
    assert estimate(saving, _ds(3, "bf16"), layout).host == 14 * -(-share.total // 4)
    # in-memory snapshots: the module's weights (none under ZeRO-3) and the optimizer partition, own + buddy's,
    # each twice at the peak
    assert z1.snapshots == 0
    snapshots = RunConfig(
        model=ModelConfig(**MODEL), checkpoint=CheckpointConfig(memory_interval=5)
    )
    part = 12 * -(-share.total // 4)
    assert estimate(snapshots, _ds(1, "bf16"), layout).snapshots == 4 * (2 * share.total + part)
    assert estimate(snapshots, _ds(3, "bf16"), layout).snapshots == 4 * part
    assert estimate(snapshots, _ds(0, "fp32"), layout).snapshots == 4 * 12 * share.total
    moe = RunConfig(model=ModelConfig(**MODEL, moe_experts=4, moe_every=1))
    experts = param_share(moe.model, Layout(dp=2, ep=2))
    model = CausalLM(moe.model, parallel=LayerParallel.without_groups(ep=2, ep_rank=0))
    one_layer = sum(p.numel() for p in model.layers[1].parameters() if hasattr(p, "expert_id"))
    assert experts.expert_layer == one_layer > experts.largest
    assert estimate(moe, _ds(1, "bf16"), Layout(dp=2, ep=2)).transient == 2 * one_layer


def _pipeline_rank(rank: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="4",
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        import deepspeed

        deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
        from keel.engine.build import build_model
        from keel.parallel.topology import Topology

        cfg = RunConfig(
            model=ModelConfig(**MODEL),
            parallel=ParallelConfig(tp=2, pp=2),
            train=TrainConfig(global_batch_size=1, micro_batch_size=1),
        )
        topology = Topology.from_env(tp=2, pp=2)
        module = build_model(cfg, topology)
        stage = topology.rank_in("pp")
        share = param_share(
            cfg.model, Layout(tp=2, pp=2), cfg.parallel.pipeline_partition, stage=stage
        )
        assert _count(module) == share.total, (rank, _count(module), share)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_share_is_the_real_pipeline_stage_at_tp2_pp2():
    """Each of 4 ranks builds its real tp=2 × pp=2 stage (DeepSpeed's partition) and counts it."""
    start_world(_pipeline_rank, (free_port(),), 4)
