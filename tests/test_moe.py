"""The MoE layer in one process: routing, capacity, aux-loss gradients, expert init; and the config rules."""

from __future__ import annotations

import math

import pytest
import torch

from keel.config import ConfigError, ModelConfig, build_config, validate
from keel.model import CausalLM
from keel.model.moe import MoE
from keel.model.router import Router
from keel.parallel.layer_parallel import LayerParallel

pytest.importorskip("deepspeed")


def moe_cfg(**changes) -> ModelConfig:
    base = dict(
        vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=2, moe_experts=4, moe_top_k=2
    )
    return ModelConfig(**{**base, **changes})


def make_router(**changes) -> Router:
    router = Router(moe_cfg(**changes))
    torch.nn.init.normal_(router.weight, std=1.0, generator=torch.Generator().manual_seed(0))
    return router


def tokens(n: int = 64, dim: int = 16) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_routing_weights_and_choices(scoring, top_k):
    route = make_router(moe_scoring=scoring, moe_top_k=top_k)(tokens())
    assert route.experts.shape == (64, top_k) and route.keep.all()  # dropless by default
    if top_k == 2:
        assert torch.allclose(route.weights.sum(-1), torch.ones(64))
        assert (route.experts[:, 0] != route.experts[:, 1]).all()
    assert torch.allclose(route.probs.sum(-1), torch.ones(64))


@pytest.mark.parametrize("policy", ["probability", "position"])
def test_capacity_drops_the_rows_its_policy_ranks_last(policy):
    router = make_router(moe_capacity_factor=1.0, moe_drop_policy=policy)
    route = router(tokens())
    capacity = math.ceil(1.0 * 64 * 2 / 4)
    kept_per_expert = torch.bincount(route.experts[route.keep], minlength=4)
    assert kept_per_expert.max() <= capacity and (~route.keep).any()
    for expert in range(4):
        rows = route.experts == expert
        over = rows & ~route.keep
        if not over.any():
            continue
        if policy == "probability":  # every kept row of this expert outweighs every dropped one
            assert route.weights[rows & route.keep].min() >= route.weights[over].max()
        else:  # first choices before second choices, then token order
            choice_kept = (rows & route.keep).nonzero()
            choice_dropped = over.nonzero()
            key = lambda rc: rc[:, 1] * 64 + rc[:, 0]  # noqa: E731
            assert key(choice_kept).max() < key(choice_dropped).min()


def test_bias_steers_choice_but_not_weights():
    router = make_router(moe_top_k=1)
    x = tokens()
    plain = router(x)
    router.balance_bias[
        plain.experts.flatten().mode().values
    ] = -10.0  # the most-chosen expert is avoided
    steered = router(x)
    assert (steered.experts != plain.experts).any()
    scores = torch.nn.functional.linear(x, router.weight).softmax(-1)
    assert torch.allclose(steered.weights, scores.gather(-1, steered.experts))


def test_aux_losses_reach_gradients_as_if_added_to_the_loss():
    """`_AttachAuxLoss` (backward-only) gives the gradients of loss + aux, with aux_grad_scale = the loss's."""
    torch.manual_seed(0)
    layer = MoE(
        moe_cfg(moe_capacity_factor=1.25, moe_shared_expert=True, moe_z_loss=0.01, moe_aux_loss=0.1)
    )
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 8, 16, requires_grad=True)
    readout = torch.randn(2, 8, 16)

    layer.aux_grad_scale = 0.5  # e.g. 2 accumulated micro-batches
    (0.5 * (layer(x) * readout).sum()).backward()
    attached = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]

    layer.zero_grad()
    x.grad = None
    layer.aux_grad_scale = 0.0
    explicit = (layer(x) * readout).sum() + layer.router(x.reshape(-1, 16)).aux_loss
    (0.5 * explicit).backward()
    reference = [p.grad for p in layer.parameters()] + [x.grad]
    router_grad = layer.router.weight.grad
    assert router_grad.abs().sum() > 0
    for a, b in zip(attached, reference):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", ["dropless", "drops", "empty experts"])
def test_grouped_gemm_equals_the_expert_loop(case):
    """torch's grouped GEMM (the CUDA bf16 path, forced here: it also runs on CPU in fp32) gives the per-expert
    loop's outputs and gradients, with dropped rows and with experts that receive no rows."""
    torch.manual_seed(0)
    capacity, shape = {
        "dropless": (0.0, (2, 12)),
        "drops": (0.5, (2, 12)),
        "empty experts": (0.0, (1, 3)),
    }[case]
    layer = MoE(moe_cfg(moe_experts=8, moe_capacity_factor=capacity, moe_shared_expert=True))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, readout = torch.randn(*shape, 16), torch.randn(*shape, 16)
    route = layer.router(x.reshape(-1, 16))
    routed = torch.bincount(route.experts[route.keep], minlength=8)
    assert {
        "dropless": route.keep.all(),
        "drops": (~route.keep).any(),
        "empty experts": (routed == 0).any(),
    }[case]
    results = []
    for grouped in (False, True):
        layer.zero_grad()
        layer.grouped_gemm = grouped
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        (out * readout).sum().backward()
        results.append([out.detach(), inputs.grad] + [p.grad for p in layer.parameters()])
    for loop, grouped in zip(*results):
        assert torch.allclose(loop, grouped, rtol=1e-5, atol=1e-6)


def test_the_grouped_gemm_keeps_no_copy_of_the_expert_weights_for_backward():
    """What the grouped path saves for backward holds no stacked copy of the weights (autograd's own stack +
    grouped_mm kept one per layer per micro-batch in flight); bench/moe_memory.py measures both."""
    torch.manual_seed(0)
    layer = MoE(moe_cfg(moe_experts=8))
    layer.grouped_gemm = True
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    expert_bytes = sum(p.numel() * p.element_size() for p in layer.local_experts.parameters())
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(2, 12, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    largest = max(kept.values())
    assert largest < expert_bytes / 2, (
        largest,
        expert_bytes,
    )  # activations only, each far below the weights
    out.sum().backward()  # an expanded gradient reaches the kernel as a real tensor
    assert all(p.grad is not None for p in layer.local_experts.parameters())


def test_expert_weights_do_not_depend_on_ep():
    cfg = moe_cfg()
    whole = CausalLM(cfg, seed=3)
    half = CausalLM(cfg, seed=3, parallel=LayerParallel.without_groups(ep=2, ep_rank=1))
    a, b = whole.layers[1].feed_forward, half.layers[1].feed_forward
    assert torch.equal(a.router.weight, b.router.weight)
    for local, expert in enumerate((2, 3)):
        for p, q in zip(b.local_experts[local].parameters(), a.local_experts[expert].parameters()):
            assert torch.equal(p, q)
    assert torch.equal(whole.layers[2].attention.wq.weight, half.layers[2].attention.wq.weight)


def test_moe_every_places_moe_blocks():
    model = CausalLM(moe_cfg(n_layers=4, moe_every=2), seed=0)
    kinds = [type(block.feed_forward).__name__ for block in model.layers[1:5]]
    assert kinds == ["SwiGLU", "MoE", "SwiGLU", "MoE"]


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        ({"parallel": {"ep": 2}}, 2, "needs a mixture-of-experts model"),
        (
            {"parallel": {"ep": 2}, "model": {"moe_experts": 3}},
            2,
            "must be divisible by parallel.ep=2",
        ),
        (
            {"parallel": {"ep": 4}, "model": {"moe_experts": 4}},
            2,
            "must divide the data-parallel size",
        ),
        ({"model": {"moe_experts": 4, "moe_top_k": 3}}, 1, "model.moe_top_k"),
        ({"model": {"moe_experts": 4, "moe_scoring": "relu"}}, 1, "model.moe_scoring"),
        ({"model": {"moe_experts": 4, "moe_drop_policy": "random"}}, 1, "model.moe_drop_policy"),
        ({"model": {"moe_experts": 1}}, 1, "needs >= 2 experts"),
        (
            {"parallel": {"sp": 2}, "model": {"n_heads": 4, "dim": 64}, "data": {"seq_len": 31}},
            2,
            "data.seq_len=31",
        ),
        (
            {"parallel": {"sp": 4}, "model": {"n_heads": 2, "dim": 64, "n_kv_heads": 2}},
            4,
            "must divide the attention",
        ),
        (
            {"parallel": {"sp": 2, "pp": 2}, "data": {"document_mask": True}},
            4,
            "data.document_mask with parallel.pp=2",
        ),
        (
            {"parallel": {"tp": 2}, "model": {"moe_experts": 4, "moe_ffn_hidden": 33}},
            2,
            "model.moe_ffn_hidden",
        ),
    ],
)
def test_bad_moe_and_sequence_parallel_settings_are_one_line_errors(overrides, world, message):
    cfg = build_config(overrides)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")) as info:
        validate(cfg, world)
    assert "\n" not in str(info.value)


def test_example_moe_config_validates_expert_parallel():
    from pathlib import Path

    from keel.config import load_config

    cfg = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "moe.yaml", ["parallel.ep=2"]
    )
    validate(cfg, 2)
    assert cfg.model.moe_experts == 8 and cfg.parallel.ep == 2
