"""Model tests: equality with HF LlamaForCausalLM, init, weight sharing, causality, FLOPs, the layer list."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from keel.config import INITS, NORMS, ConfigError, ModelConfig
from keel.model import (
    CausalLM,
    FinalNorm,
    OutputLayer,
    build_layers,
    causal_lm_loss,
    flops_per_token,
    from_hf_state_dict,
    init_weights,
    num_params,
    to_hf_config,
    to_hf_state_dict,
    weight_decay_groups,
)
from keel.model.layers import NORM_CLASSES
from keel.model.llama import TRUNCATED_BY_INIT

SEQ = 16


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, rope_theta=10000.0)
    return ModelConfig(**{**base, **overrides})


def tokens(cfg: ModelConfig, batch: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed)
    )


def hf_model(model: CausalLM):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(to_hf_config(model.cfg)).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=True)
    return hf


EQUALITY_CASES = [
    pytest.param(dict(tie_embeddings=True), id="gqa-tied"),
    pytest.param(dict(tie_embeddings=False), id="gqa-untied"),
    pytest.param(dict(n_kv_heads=4, tie_embeddings=True), id="mha-tied"),
    pytest.param(
        dict(n_kv_heads=4, tie_embeddings=False, rope_theta=500000.0, norm_eps=1e-6),
        id="mha-untied",
    ),
    pytest.param(dict(n_kv_heads=1, ffn_hidden=96), id="mqa"),
]


@pytest.mark.parametrize("overrides", EQUALITY_CASES)
def test_logits_and_loss_match_hf(overrides):
    model = CausalLM(tiny(**overrides), seed=3).eval()
    hf = hf_model(model)
    x = tokens(model.cfg)
    with torch.no_grad():
        ours = model(x)
        theirs = hf(input_ids=x).logits
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        # HF shifts labels itself (position t predicts labels[t + 1]); Keel takes targets already aligned
        targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
        torch.testing.assert_close(
            model(x, labels=targets), hf(input_ids=x, labels=x).loss, atol=1e-5, rtol=1e-5
        )
        # and with every position supervised, through HF's shift_labels (used in place of labels when given)
        y = tokens(model.cfg, seed=1)
        theirs = hf(input_ids=x, labels=y, shift_labels=y).loss
        torch.testing.assert_close(model(x, labels=y), theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_hf_round_trip(tie):
    source = CausalLM(tiny(tie_embeddings=tie), seed=1).eval()
    target = CausalLM(tiny(tie_embeddings=tie), seed=2).eval()
    x = tokens(source.cfg)
    assert not torch.allclose(source(x), target(x))
    from_hf_state_dict(target, {k: v.clone() for k, v in to_hf_state_dict(source).items()})
    torch.testing.assert_close(target(x), source(x), atol=0, rtol=0)
    if tie:
        assert target.layers[-1].output.weight is target.layers[0].tok_embeddings.weight


def test_from_hf_state_dict_is_strict():
    model = CausalLM(tiny(tie_embeddings=True))
    state = dict(to_hf_state_dict(model))
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="lm_head"):
        from_hf_state_dict(model, state)
    state = dict(to_hf_state_dict(model))
    del state["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        from_hf_state_dict(model, state)
    with pytest.raises(ValueError, match="layernorm"):
        to_hf_config(tiny(norm="layernorm"))


def test_init_statistics():
    cfg = tiny(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=1024, tie_embeddings=False)
    model = CausalLM(cfg, seed=0)
    scaled = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for name, param in model.named_parameters():
        if param.ndim < 2:
            assert torch.all(param == 1.0), name
            continue
        expected = scaled if name.endswith(("wo.weight", "w2.weight")) else cfg.init_std
        assert abs(param.mean().item()) < 0.05 * expected, name
        assert param.std().item() == pytest.approx(expected, rel=0.03), name


def test_truncated_normal_init_and_layernorm():
    cfg = tiny(dim=256, n_layers=4, n_heads=8, init="truncated_normal", norm="layernorm")
    model = CausalLM(cfg, seed=0)
    scaled = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(param == 0.0), name
        elif param.ndim < 2:
            assert torch.all(param == 1.0), name
        else:
            sigma = scaled if name.endswith(("wo.weight", "w2.weight")) else cfg.init_std
            assert param.abs().max().item() <= 3 * sigma * (1 + 1e-6), name
            assert param.abs().max().item() > 2.5 * sigma, name  # truncated, not squashed
    assert any(name.endswith("norm.bias") for name, _ in model.named_parameters())


def test_init_is_deterministic_per_seed():
    cfg = tiny(tie_embeddings=False)
    a, b, c = CausalLM(cfg, seed=7), CausalLM(cfg, seed=7), CausalLM(cfg, seed=8)
    torch.manual_seed(123)  # the global RNG plays no part
    d = CausalLM(cfg, seed=7)
    for (name, pa), pb, pc, pd in zip(
        a.named_parameters(), b.parameters(), c.parameters(), d.parameters(), strict=True
    ):
        assert torch.equal(pa, pb) and torch.equal(pa, pd), name
        if pa.ndim >= 2:
            assert not torch.equal(pa, pc), name


@pytest.mark.parametrize("tie", [True, False])
def test_init_is_independent_of_the_split(tie):
    """A pipeline stage initialising only its slice gets the single-process values, tied head included."""
    cfg = tiny(n_layers=3, tie_embeddings=tie)
    full = CausalLM(cfg, seed=5).layers
    # stage 1 holds blocks 1..2 (list indices 2, 3) and the head, built apart from the embedding
    blocks = build_layers(cfg)[2:4]
    stage = [*blocks, FinalNorm(cfg), OutputLayer(cfg, tied_embedding=None)]
    head = stage[-1]
    init_weights(stage, cfg, seed=5, first_index=2)
    for mine, reference in zip(stage, list(full)[2:], strict=True):
        for (name, p), q in zip(mine.named_parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q), name
    if not tie:
        assert not torch.equal(head.output.weight, full[0].tok_embeddings.weight)


def test_tied_embeddings_share_one_parameter():
    cfg = tiny(tie_embeddings=True)
    model = CausalLM(cfg)
    embedding, head = model.layers[0].tok_embeddings.weight, model.layers[-1].output.weight
    assert head is embedding
    groups = weight_decay_groups(model, 0.1)
    listed = [p for group in groups for p in group["params"]]
    assert len(listed) == len({id(p) for p in listed}) == len(list(model.parameters()))
    assert sum(p is embedding for p in listed) == 1
    decay = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    no_decay = {id(p) for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    assert id(embedding) in decay
    for name, param in model.named_parameters():
        assert (id(param) in no_decay) == ("norm" in name), name

    # 256·64 embedding (= head) + 2 blocks of 49152 matmul weights + 5 norms of 64
    assert num_params(model) == 16384 + 2 * 49152 + 5 * 64
    assert num_params(model, exclude_embeddings=True) == 2 * 49152 + 5 * 64
    untied = CausalLM(tiny(tie_embeddings=False))
    assert num_params(untied) == 2 * 16384 + 2 * 49152 + 5 * 64
    assert num_params(untied, exclude_embeddings=True) == 16384 + 2 * 49152 + 5 * 64


def test_tied_gradients_accumulate_into_the_shared_weight():
    model = CausalLM(tiny(tie_embeddings=True))
    x = tokens(model.cfg)
    model(x, labels=tokens(model.cfg, seed=1)).backward()
    grad = model.layers[0].tok_embeddings.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_causality():
    model = CausalLM(tiny(), seed=0).eval()
    x = tokens(model.cfg)
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], atol=0, rtol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_flops_per_token():
    cfg = tiny()  # dim 64, 2 layers, 4 heads of 16, 2 kv heads, ffn 8/3·64 = 170 → 192, vocab 256
    assert cfg.ffn_dim == 192
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64  # wq, wkv (k and v), wo = 12288
    mlp = 3 * 64 * 192  # w13 (gate and up), w2 = 36864
    n = 2 * (attention + mlp) + 64 * 256  # 114688, head included
    assert flops_per_token(cfg, 128) == 6 * n + 12 * 2 * 64 * 128 == 884736
    # matches 6·(non-embedding params + head) when tied, norms aside
    model = CausalLM(cfg)
    norm_params = 5 * 64
    assert 6 * (num_params(model, exclude_embeddings=True) - norm_params + 64 * 256) == 6 * n


def test_layer_list_applied_one_by_one_equals_forward():
    model = CausalLM(tiny(), seed=0).eval()
    x = tokens(model.cfg)
    h = x
    shapes = []
    for layer in model.layers:
        h = layer(h)
        shapes.append(tuple(h.shape))
    assert shapes == [(2, SEQ, 64)] * 4 + [(2, SEQ, 256)]
    torch.testing.assert_close(h, model(x), atol=0, rtol=0)
    assert len(model.layers) == model.cfg.n_layers + 3


def test_rope_cache_is_lazy_nonpersistent_and_follows_input():
    model = CausalLM(tiny(), seed=0).eval()
    assert not any("cos" in k or "sin" in k for k in model.state_dict())
    # one pair of tables for every block, not one per block
    assert len({id(layer.attention.rotary) for layer in model.layers[1:-2]}) == 1
    x = tokens(model.cfg, seq=SEQ)
    with torch.no_grad():
        short = model(x[:, :8])  # builds an 8-long cache, then grows it for 16
        full = model(x)
    torch.testing.assert_close(short, full[:, :8], atol=1e-6, rtol=1e-6)
    rotary = model.layers[1].attention.rotary
    assert rotary.cos.shape == (SEQ, model.cfg.head_dim)
    model.to(torch.bfloat16)
    with torch.no_grad():
        loss = model(x, labels=x)
    assert rotary.cos.dtype == torch.bfloat16
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    model.to(torch.float32)  # a bf16-rounded table cast back up must be rebuilt, not reused
    with torch.no_grad():
        torch.testing.assert_close(model(x), full, atol=1e-2, rtol=0)
    fresh = CausalLM(tiny(), seed=0).layers[1].attention.rotary
    fresh(torch.zeros(1, 1, SEQ, model.cfg.head_dim))
    torch.testing.assert_close(rotary.cos, fresh.cos, atol=0, rtol=0)


def test_causal_lm_loss_ignores_masked_positions():
    logits = torch.randn(2, 4, 10, dtype=torch.bfloat16)
    labels = torch.tensor([[1, 2, -100, 3], [4, -100, -100, 5]])
    keep = labels != -100
    expected = torch.nn.functional.cross_entropy(logits.float()[keep], labels[keep])
    loss = causal_lm_loss(logits, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected)


def test_dropout_only_in_training():
    model = CausalLM(tiny(dropout=0.5), seed=0)
    x = tokens(model.cfg)
    model.train()
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))


@pytest.mark.parametrize(
    "field, value",
    [
        ("vocab_size", 0),
        ("n_kv_heads", 3),
        ("norm", "batchnorm"),
        ("init", "xavier"),
        ("n_heads", 5),
    ],
)
def test_build_rejects_bad_config(field, value):
    with pytest.raises(ConfigError, match=f"model.{field}|model.n_heads"):
        build_layers(dataclasses.replace(tiny(), **{field: value}))


def test_name_tables_cover_exactly_the_names_the_config_admits():
    """make_norm and init_weights index these by name; validate_model is what refuses any other name."""
    assert set(NORM_CLASSES) == set(NORMS)
    assert set(TRUNCATED_BY_INIT) == set(INITS)


def test_pipeline_stage_blocks_share_one_pair_of_rope_tables():
    """The pipeline's layer specs hand every block the same tables, as `build_layers` does."""
    from keel.config import RunConfig
    from keel.engine.pipeline import layer_specs

    blocks = [spec.build() for spec in layer_specs(RunConfig(model=tiny(n_layers=3)))[1:-2]]
    assert len(blocks) == 3 and len({id(b.attention.rotary) for b in blocks}) == 1
