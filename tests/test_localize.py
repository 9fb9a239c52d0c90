"""Non-finite localization: replays name the first bad module and gradients, classify, and disturb nothing."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from keel.config import ModelConfig
from keel.launcher.local import free_port
from keel.model import CausalLM
from keel.training.guards.localize import DATA, ROOT, TRANSIENT, Finding, classify, localize
from tests.spawned import rank_env, start_world

CFG = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_pad_multiple=16)
NAN = float("nan")


def tiny(**overrides) -> CausalLM:
    return CausalLM(ModelConfig(**{**CFG, **overrides}), seed=0)


def micro_batches(n: int = 2, b: int = 2, s: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG["vocab_size"], (b, s + 1), generator=g) for _ in range(n)]


def test_poisoned_weight_is_data_at_its_module():
    model = tiny()
    with torch.no_grad():
        model.layers[2].attention.wo.weight[0, 0] = NAN
    loc = localize(model, micro_batches(), sample_indices=[10, 11, 12, 13])
    assert (loc.first_bad_module, loc.first_bad_class) == (
        "layers.2.attention.wo",
        "RowParallelLinear",
    )
    assert loc.origin_module == "layers.2.attention.wo"
    assert loc.micro_batch == 0 and loc.bad_micro_batches == [0, 1]
    assert math.isnan(loc.loss)
    assert loc.bad_params == ["layers.2.attention.wo.weight"]
    # a NaN loss makes every gradient NaN; the list opens nearest the loss, the count says "all"
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    assert loc.n_bad_grads == n_params and len(loc.bad_grads) == 5
    assert loc.bad_grads[:2] == ["layers.3.norm.weight", "layers.2.feed_forward.w2.weight"]
    assert loc.reproducible and loc.classification == DATA and loc.replays_nonfinite == 2
    assert loc.samples == [10, 11, 12, 13]  # every row of both micro-batches went bad
    event = loc.event()
    assert (
        "findings" not in event
        and json.loads(json.dumps(event))["origin_module"] == "layers.2.attention.wo"
    )


@pytest.mark.fault(
    "non-finite embedding row hit by one sample", "localization names the row and the sample"
)
def test_bad_token_names_its_row_and_sample():
    """A non-finite embedding row hit by one sample only: that sample, in the second micro-batch, is named."""
    model = tiny(tie_embeddings=False)
    batches = micro_batches()
    bad_token = CFG["vocab_size"] - 1
    for batch in batches:
        batch[batch == bad_token] = 0
    batches[1][1, 3] = bad_token
    with torch.no_grad():
        model.layers[0].tok_embeddings.weight[bad_token] = float("inf")
    loc = localize(model, batches, sample_indices=[40, 41, 42, 43])
    assert loc.first_bad_module == loc.origin_module == "layers.0.tok_embeddings"
    assert loc.micro_batch == 1 and loc.bad_micro_batches == [1]
    assert loc.findings[0].bad_rows == [1] and loc.samples == [43]
    assert loc.classification == DATA


def test_first_bad_and_origin_differ_when_a_parent_makes_the_value():
    """Overflow in Block's own residual add: the next norm returns it first, but the Block made it."""
    model = tiny()

    def huge(module, args, output):
        return torch.full_like(output, 2e38)  # finite, but two of them overflow fp32 when added

    model.layers[0].register_forward_hook(huge)  # the residual stream entering block 1
    model.layers[1].attention.register_forward_hook(huge)  # its attention branch
    loc = localize(model, micro_batches(n=1))
    # first to return a non-finite value: its input was inf
    assert loc.first_bad_module == "layers.1.ffn_norm"
    assert (loc.origin_module, loc.origin_class) == (
        "layers.1",
        "Block",
    )  # finite in, inf out: the add
    assert loc.classification == DATA


def test_transient_fault_in_the_step_is_not_reproduced():
    model = tiny()
    calls = []

    def once(module, args, output):
        calls.append(1)
        return output * NAN if len(calls) == 1 else None

    model.layers[1].feed_forward.register_forward_hook(once)
    batches = micro_batches()
    # the step that was skipped
    assert math.isnan(model(batches[0][:, :-1], batches[0][:, 1:]).item())
    loc = localize(model, batches)
    assert loc.first_bad_module is None and loc.bad_micro_batches == [] and loc.samples == []
    assert not loc.reproducible and loc.classification == TRANSIENT and loc.replays_nonfinite == 0


def test_fault_in_one_replay_only_is_transient_and_reported():
    model = tiny()
    calls = []

    def once(module, args, output):
        calls.append(1)
        return output * NAN if len(calls) == 1 else None

    model.layers[1].feed_forward.register_forward_hook(once)
    loc = localize(model, micro_batches())
    assert loc.classification == TRANSIENT and loc.replays_nonfinite == 1 and not loc.reproducible
    # found by the first replay
    assert loc.first_bad_module == "layers.1.feed_forward" and loc.micro_batch == 0


def test_inf_in_the_loss_only_points_at_the_model():
    model = tiny()
    loss_fn = model.loss_fn
    model.loss_fn = lambda logits, labels: loss_fn(logits, labels) + math.inf
    loc = localize(model, micro_batches())
    assert (loc.first_bad_module, loc.first_bad_class) == (
        ROOT,
        "CausalLM",
    )  # every layer's output was finite
    assert loc.origin_module == ROOT
    assert loc.loss == math.inf and loc.findings[0].bad_rows == []
    assert loc.bad_grads == [] and loc.n_bad_grads == 0  # d(loss + inf) = d(loss): finite
    assert loc.classification == DATA


@pytest.mark.fault("NaN only in the backward pass", "localization names the bad gradients")
def test_backward_only_nan_is_found_in_the_gradients():
    model = tiny()

    def nan_grad(module, args, output):
        output.register_hook(lambda grad: grad * NAN)

    model.layers[2].feed_forward.w2.register_forward_hook(nan_grad)
    with torch.no_grad():  # gradients are taken even when the caller has them off
        loc = localize(model, micro_batches())
    assert loc.first_bad_module is None and loc.origin_module is None and math.isfinite(loc.loss)
    assert loc.bad_grads[0] == "layers.2.feed_forward.w2.weight"
    # downstream of the NaN: its gradient stays finite
    assert "layers.3.norm.weight" not in loc.bad_grads
    assert loc.classification == DATA


def test_healthy_batch_finds_nothing():
    loc = localize(tiny(), micro_batches())
    assert loc.first_bad_module is None and loc.micro_batch is None and loc.bad_grads == []
    assert loc.classification == TRANSIENT and loc.replays_nonfinite == 0


@pytest.mark.parametrize("checkpoint_interval", [0, 1])
def test_replay_leaves_grads_hooks_rng_and_modes_alone(checkpoint_interval):
    """What ZeRO-1/2/3 rely on is untouched: `.grad`, post-accumulate hooks, AccumulateGrad hooks, RNG, modes."""
    model = CausalLM(
        ModelConfig(**CFG, dropout=0.5), seed=0, checkpoint_interval=checkpoint_interval
    )
    with torch.no_grad():
        model.layers[2].attention.wo.weight[0, 0] = NAN
    params = [p for p in model.parameters() if p.requires_grad]
    for i, p in enumerate(params):  # as mid-accumulation: some gradients held, some not
        p.grad = torch.full_like(p, float(i)) if i % 2 else None
    grads_before = [None if p.grad is None else (p.grad, p.grad.clone()) for p in params]
    fired = []
    accumulators = []
    for p in params:
        # ZeRO's hook on torch >= 2.1
        p.register_post_accumulate_grad_hook(lambda p: fired.append("post"))
        accumulator = p.expand_as(p).grad_fn.next_functions[0][
            0
        ]  # the older AccumulateGrad-node hook
        accumulator.register_hook(lambda *grads: fired.append("acc"))
        accumulators.append(accumulator)  # keep the node (and its hook) alive
    model.eval()
    model.layers[1].train()
    modes = [m.training for m in model.modules()]
    rng = torch.get_rng_state()

    loc = localize(model, micro_batches())

    # dropout masks agree
    assert loc.first_bad_module == "layers.2.attention.wo" and loc.classification == DATA
    assert fired == []
    for p, before in zip(params, grads_before):
        if before is None:
            assert p.grad is None
        else:
            assert p.grad is before[0] and torch.equal(p.grad, before[1])
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == modes
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    # the hooks are live: an ordinary backward fires both
    batch = micro_batches(n=1)[0]
    model(batch[:, :-1], batch[:, 1:]).backward()
    assert {"post", "acc"} <= set(fired)


def test_both_replays_draw_the_same_dropout_masks():
    model = CausalLM(ModelConfig(**CFG, dropout=0.5), seed=0)
    losses = []
    model.register_forward_hook(lambda module, args, loss: losses.append(loss.item()))
    localize(model, micro_batches())
    # the second replay saw exactly what the first did
    assert len(losses) == 4 and losses[:2] == losses[2:]
    model.eval()
    batch = micro_batches()[0]
    # and dropout was on in the replay
    assert model(batch[:, :-1], batch[:, 1:]).item() != losses[0]


def test_classify_needs_the_same_place_twice():
    def at(micro_batch: int, module: str | None) -> Finding:
        return Finding(micro_batch, module, "X", module, "X", [], NAN, [], 0, [])

    assert classify([at(0, "a")], [at(0, "a")]) == DATA
    assert classify([at(0, "a")], [at(0, "b")]) == TRANSIENT
    assert classify([at(0, "a")], [at(1, "a")]) == TRANSIENT
    assert classify([at(0, "a")], []) == TRANSIENT
    assert classify([], []) == TRANSIENT


# -- under real DeepSpeed engines ---------------------------------------------------------------------------------


def _engine(stage: int, tp: int = 1):
    from keel.config import ParallelConfig, RunConfig, TrainConfig
    from keel.engine.build import build_engine
    from keel.engine.distributed import init_distributed
    from keel.parallel.topology import Topology

    init_distributed()
    ds_raw = json.loads(
        (Path(__file__).parents[1] / "ds_configs" / f"zero{stage}.json").read_text()
    )
    # partition even tiny params
    ds_raw["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    dp = int(os.environ["WORLD_SIZE"]) // tp
    cfg = RunConfig(
        model=ModelConfig(**CFG),
        parallel=ParallelConfig(tp=tp),
        train=TrainConfig(
            global_batch_size=4 * dp, micro_batch_size=2, lr=1e-2, warmup_steps=0, seed=0
        ),
    )
    torch.manual_seed(0)
    return build_engine(cfg, ds_raw, Topology.from_env(tp=tp))


def _step(engine, pair: list[torch.Tensor]) -> None:
    for i, batch in enumerate(pair):
        engine.set_gradient_accumulation_boundary(i == len(pair) - 1)
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()


def _zero_worker(rank: int, port: int, stage: int, results: dict) -> None:
    import deepspeed

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    batches = micro_batches(n=6, seed=1)
    losses = {}
    for with_localize in (False, True):
        engine = _engine(stage)
        _step(engine, batches[0:2])
        if with_localize:
            results["healthy"] = localize(engine.module, batches[2:4]).event()
            handle = engine.module.layers[2].attention.wo.register_forward_hook(
                lambda m, a, out: out * NAN
            )
            results["poisoned"] = localize(engine.module, batches[2:4]).event()
            handle.remove()
            if stage == 3:  # the embedding's backward release never fires outside engine.backward
                results["left_gathered"] = [
                    n for n, p in engine.module.named_parameters() if p.numel()
                ]
                engine.empty_partition_cache()
                with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                    pass  # what checkpoint saving and checksums do: fails while a param is left gathered
        _step(engine, batches[2:4])
        _step(engine, batches[4:6])
        with torch.no_grad():
            losses[with_localize] = engine(batches[0][:, :-1], batches[0][:, 1:]).item()
    results["losses"] = losses


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_localize_under_zero_leaves_training_unchanged(stage):
    """Localizing between steps of a real engine changes nothing, and finds the module under every ZeRO stage."""
    with mp.Manager() as manager:
        results = manager.dict()
        start_world(_zero_worker, (free_port(), stage, results), 1)
        results = dict(results)
    assert results["healthy"]["first_bad_module"] is None
    poisoned = results["poisoned"]
    assert (
        poisoned["first_bad_module"] == "layers.2.attention.wo"
        and poisoned["classification"] == DATA
    )
    n_params = sum(1 for p in tiny().parameters() if p.requires_grad)
    # ZeRO-3 too: autograd.grad reaches partitioned params (full grads)
    assert poisoned["n_bad_grads"] == n_params
    if stage == 3:
        assert results["left_gathered"] == ["layers.0.tok_embeddings.weight"]
    assert results["losses"][True] == results["losses"][False]


def _every_rank_worker(
    rank: int, world: int, port: int, stage: int, tp: int, results: dict
) -> None:
    rank_env(rank, world, port)
    engine = _engine(stage, tp)
    dp_rank = rank // tp  # tp is the innermost grid axis
    batches = micro_batches(n=2, seed=dp_rank)
    # a fault on one rank only: in a column-parallel shard under tp, in its batch under dp
    if rank == 0:
        # the value part of the fused k/v projection: on AVX-512 CPUs torch 2.13's SDPA returns finite outputs for
        # NaN queries or keys (measured), so only a NaN in v is certain to reach the attention's all-reduce
        engine.module.layers[2].attention.wkv.register_forward_hook(
            lambda m, a, out: (out[0], out[1] * NAN)
        )
    results[rank] = localize(engine.module, batches).event()
    if stage == 3:
        engine.empty_partition_cache()
    # the ranks are still in step: a collective after localization does not hang
    _step(engine, batches)


@pytest.mark.slow
@pytest.mark.parametrize("stage, tp", [(3, 1), (1, 2)], ids=["zero3-dp2", "tp2"])
def test_localize_on_every_rank(stage, tp):
    """Called on every rank, each replays its own batch with the model's collectives matched; findings differ."""
    with mp.Manager() as manager:
        results = manager.dict()
        start_world(_every_rank_worker, (2, free_port(), stage, tp, results), 2)
        results = dict(results)
    assert results[0]["first_bad_module"] == results[0]["origin_module"] == "layers.2.attention.wkv"
    assert results[0]["classification"] == DATA
    if tp == 1:  # data parallel: rank 1's own batch is fine
        assert results[1]["first_bad_module"] is None and results[1]["classification"] == TRANSIENT
    else:  # rank 1 first sees the NaN after the attention's all-reduce: its own shards were fine
        assert results[1]["first_bad_module"] == results[1]["origin_module"] == "layers.2.attention"
        assert results[1]["classification"] == DATA


def test_gradients_are_checked_one_parameter_at_a_time(monkeypatch):
    """The replay holds one parameter's gradient at a time (under ZeRO-2/3 the whole model's at once would be the
    full replica the sharded state avoids): when each gradient is checked, no earlier one is still alive."""
    import weakref

    from keel.training.guards import localize as localize_module

    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    alive_at_check: list[int] = []
    checked: list[weakref.ref] = []
    real = localize_module._finite

    def finite(t):
        if t.dim() and t.shape[-1] == 64 and t.requires_grad is False and t.grad_fn is None:
            alive_at_check.append(sum(r() is not None for r in checked))
            checked.append(weakref.ref(t))
        return real(t)

    monkeypatch.setattr(localize_module, "_finite", finite)
    loss = model(torch.randn(3, 64)).square().sum()
    named = list(model.named_parameters())
    assert localize_module._bad_grads(loss, named) == []
    assert len(alive_at_check) == len(named) and max(alive_at_check) == 0, alive_at_check
