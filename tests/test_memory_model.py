"""The memory model: its parameter counts are the real model's, its ZeRO stages divide what the paper says, and
context parallelism divides the activations by cp (what torch saves under cp, in a real 2-rank world)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from keel.config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from keel.engine.activations import ActivationShape, block_bytes, head_bytes, ring_bytes
from keel.engine.memory_model import Layout, estimate, param_share
from keel.launcher.local import free_port
from keel.model import CausalLM
from keel.parallel.layer_parallel import LayerParallel
from tests.spawned import rank_env, start_world
from tests.test_activations import saved_bytes

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
    # reduce bucket, prefetch bucket + the largest parameter, and the prefetch bucket's flat all-gather buffer
    assert z3.buckets == 4 * (1000 + 500 + param_share(cfg.model, layout).largest + 500)
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
    assert z1.transient == 2 * share.largest
    # one micro-batch a step (16 samples over dp 4 at micro-batch 4): gradients and activations never together
    assert not z1.accumulates and z1.peak == (
        z1.params
        + z1.optimizer
        + z1.buckets
        + max(z1.grads, z1.activations)
        + 2 * share.largest
        + z1.transient
    )
    accumulating = RunConfig(model=ModelConfig(**MODEL))
    accumulating.train.global_batch_size = 64
    z1 = estimate(accumulating, _ds(1, "bf16"), layout)
    assert z1.accumulates and z1.peak == z1.total + z1.activations + z1.transient
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
    rank_env(rank, 4, port)
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


# -- context parallelism ------------------------------------------------------------------------------------------
LONG = dict(vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, compile="false")


CP_CASES = {
    "dense": ({}, False, 1, False),
    "qk_norm tp2 SP": ({"qk_norm": True}, False, 2, True),
    "moe": ({"moe_experts": 4, "moe_top_k": 2}, True, 1, False),
}


@pytest.mark.parametrize("sp", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CP_CASES))
def test_cp_divides_every_position_wise_activation(case, precision, sp):
    """Each cp rank holds s/cp tokens of every sequence (s/(cp·sp) with Ulysses): a block's and the head's
    activations at cp = 2, 4 are exactly 1/2, 1/4 of cp = 1's, dense and MoE, with and without Megatron SP."""
    extra, moe, tp, sequence_parallel = CP_CASES[case]
    cfg = ModelConfig(**{**LONG, **extra})
    shapes = {
        cp: ActivationShape(2, 4096, precision, tp, sp, sequence_parallel, cp) for cp in (1, 2, 4)
    }
    one_block, one_head = block_bytes(cfg, shapes[1], moe), head_bytes(cfg, shapes[1], 512, False)
    for cp in (2, 4):
        assert shapes[cp].tokens == 2 * 4096 // (cp * sp)
        assert block_bytes(cfg, shapes[cp], moe) * cp == one_block
        assert head_bytes(cfg, shapes[cp], 512, False) * cp == one_head


def _long_run(seq_len: int, **data) -> RunConfig:
    return RunConfig(
        model=ModelConfig(**LONG),
        data=DataConfig(seq_len=seq_len, **data),
        train=TrainConfig(global_batch_size=8, micro_batch_size=2),
    )


def test_estimate_divides_activations_by_cp_and_partitions_zero_over_the_sequence_ranks():
    """A rank of dp=2 × cp=2 keeps half the activations of dp=2 alone; its ZeRO state is partitioned over the 4
    ranks that replicate the parameters (DeepSpeed's sequence-data-parallel group), as under Ulysses sp=2."""
    run = _long_run(4096)
    base, cp2 = (
        estimate(run, _ds(1, "bf16"), Layout(dp=2)),
        estimate(run, _ds(1, "bf16"), Layout(dp=2, cp=2)),
    )
    assert cp2.activations * 2 == base.activations > 0
    four = estimate(run, _ds(3, "bf16"), Layout(dp=4))
    for layout in (Layout(dp=2, cp=2), Layout(dp=2, sp=2), Layout(dp=1, cp=2, sp=2)):
        spread = estimate(run, _ds(3, "bf16"), layout)
        assert (spread.params, spread.grads, spread.optimizer) == (
            four.params,
            four.grads,
            four.optimizer,
        )
        assert spread.params < estimate(run, _ds(3, "bf16"), Layout(dp=layout.dp)).params
    # the experts: over dp / ep × cp × sp
    moe = RunConfig(model=ModelConfig(**MODEL, moe_experts=4, moe_every=1))
    expert = param_share(moe.model, Layout(dp=4, ep=2)).expert
    z1 = estimate(moe, _ds(1), Layout(dp=4, ep=2, cp=2))
    dense = param_share(moe.model, Layout(dp=4, ep=2)).dense
    assert z1.optimizer == 12 * (-(-dense // 8) + -(-expert // 4))


def test_the_ring_buffers_are_the_transient_under_cp():
    """cp's short-lived buffers (one block's attention at a time): other ranks' K/V in flight (one buffer the size
    of the local K and V at cp = 2, two beyond), three fp32 dK/dV pairs (accumulating, being sent, arriving) and an
    fp32 dq; under document masking one chunk pair's c×c masks. None at cp = 1."""
    cfg = ModelConfig(**LONG)  # q = 256, kv = 4 heads × 32 = 128 per rank
    bf16 = dict(micro_batch=1, seq_len=4096, precision="bf16")
    assert ring_bytes(cfg, ActivationShape(**bf16)) == 0
    t = 4096 // 2
    kv_buffer, grads, dq = 2 * t * 2 * 128, 3 * 4 * t * 2 * 128, 4 * t * 256
    assert ring_bytes(cfg, ActivationShape(**bf16, cp=2)) == kv_buffer + grads + dq
    t = 4096 // 4
    kv_buffer, grads, dq = 2 * t * 2 * 128, 3 * 4 * t * 2 * 128, 4 * t * 256
    assert ring_bytes(cfg, ActivationShape(**bf16, cp=4)) == 2 * kv_buffer + grads + dq
    c = 4096 // 8
    masked = ring_bytes(cfg, ActivationShape(**bf16, cp=4, document_mask=True))
    assert masked - ring_bytes(cfg, ActivationShape(**bf16, cp=4)) == (1 + 2) * c * c
    # Ulysses sp=8 cannot split 4 kv heads: it sends one per query head, and the ring carries those
    wide = ActivationShape(**bf16, cp=2, sp=8)
    t = 4096 // 16
    assert ring_bytes(cfg, wide) == 2 * t * 2 * 256 + 3 * 4 * t * 2 * 256 + 4 * t * 256
    # the estimate's transient: the largest of the ring's and the rare paths'
    run = _long_run(4096)
    z1 = estimate(run, _ds(1, "bf16"), Layout(dp=2, cp=2))
    shape = ActivationShape(2, 4096, "bf16", cp=2)
    assert (
        z1.transient == ring_bytes(run.model, shape) > 2 * param_share(run.model, Layout()).largest
    )


def test_document_masking_keeps_an_s_by_s_mask_per_block_but_not_under_cp():
    """SDPA keeps the packed documents' mask, made additive in the run's dtype, in every block (b·s² each), and
    the boolean mask lives with the micro-batch; the ring builds c×c masks as it goes and keeps none."""
    cfg = ModelConfig(**LONG)
    s = 4096
    plain = block_bytes(cfg, ActivationShape(2, s, "bf16"))
    assert (
        block_bytes(cfg, ActivationShape(2, s, "bf16", document_mask=True)) == plain + 2 * 2 * s**2
    )
    cp2 = ActivationShape(2, s, "bf16", cp=2)
    assert block_bytes(cfg, cp2) == block_bytes(cfg, replace(cp2, document_mask=True))
    # whole: both blocks keep their masks; checkpointed: one block's, while it is recomputed
    for interval, blocks in ((0, 2), (1, 1)):
        runs = [_long_run(s, document_mask=masked) for masked in (False, True)]
        for run in runs:
            run.train.activation_checkpoint_interval = interval
        (no_mask, one), (no_mask_cp, cp) = (
            [estimate(run, _ds(1, "bf16"), layout).activations for run in runs]
            for layout in (Layout(dp=2), Layout(dp=2, cp=2))
        )
        assert one - no_mask == blocks * 2 * 2 * s**2 + 2 * s**2
        assert cp == no_mask_cp == no_mask // 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_document_masked_models_activations_are_what_torch_saves(precision):
    """At s = 1024 the masks are a sixth of what the model keeps: the count without them is 15 % short."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    cfg = ModelConfig(**LONG)
    model = CausalLM(cfg, seed=0, document_eos=7).to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (2, 1025), generator=torch.Generator().manual_seed(0))
    tokens[:, [30, 400, 700]] = 7
    measured = saved_bytes(model, lambda: model(tokens[:, :-1], tokens[:, 1:]))
    shape = ActivationShape(2, 1024, precision, document_mask=True)
    predicted = cfg.n_layers * block_bytes(cfg, shape) + head_bytes(
        cfg, shape, cfg.vocab_size, False
    )
    assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured)


def _cp_rank(rank: int, port: int, eos: int | None) -> None:
    rank_env(rank, 2, port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from keel.parallel.topology import Topology

        cfg = ModelConfig(**LONG)
        parallel = LayerParallel.from_topology(Topology.from_env(cp=2))
        model = CausalLM(cfg, seed=0, parallel=parallel, document_eos=eos)
        tokens = torch.randint(
            0, cfg.vocab_size, (2, 257), generator=torch.Generator().manual_seed(0)
        )
        if eos is not None:
            tokens[:, [30, 100, 200]] = eos
        measured = saved_bytes(model, lambda: model(tokens[:, :-1], tokens[:, 1:]))
        shape = ActivationShape(2, 256, "fp32", cp=2, document_mask=eos is not None)
        predicted = cfg.n_layers * block_bytes(cfg, shape) + head_bytes(
            cfg, shape, cfg.vocab_size, False
        )
        assert abs(predicted - measured) <= 0.1 * measured, (rank, predicted, measured)
        whole = CausalLM(cfg, seed=0, document_eos=eos)
        one_process = saved_bytes(whole, lambda: whole(tokens[:, :-1], tokens[:, 1:]))
        # half of one process's, or less: under document masking the ring keeps no [s, s] masks
        assert measured <= 0.55 * one_process, (rank, measured, one_process)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("eos", [None, 7], ids=["causal", "documents"])
def test_what_torch_saves_on_a_cp_rank_is_the_count_at_s_over_cp(eos):
    """Each rank of a real cp=2 world runs the whole model's forward on its two chunks (the ring included) and
    keeps what the count says for s/2 tokens."""
    start_world(_cp_rank, (free_port(), eos), 2)
