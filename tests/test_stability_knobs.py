"""The model's stability knobs — norm placement, DeepNorm, QK-norm, small-init, the embedding's std — and the
monitor's attention-logit signal: their semantics in one process, and the same losses at every parallel layout."""

from __future__ import annotations

import math

import pytest
import torch

from keel.config import ConfigError, ModelConfig, StabilityConfig, validate_model
from keel.model import CausalLM
from keel.model.hf import llama_cannot_express
from keel.model.init import deepnorm_alpha, deepnorm_beta
from keel.model.layers import record_max_logit
from keel.parallel.topology import Topology
from keel.run_dir import AnomalyLog, read_anomalies
from keel.training.observe.attention_logits import AttentionLogitWarning
from keel.training.observe.metrics import read_metrics
from keel.training.observe.monitor import ModelMonitor
from tests.keel_runs import Run
from tests.test_train_equivalence import assert_close, assert_grad_norms_close

TINY = dict(
    vocab_size=64,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_pad_multiple=1,
    kernels="torch",
)


def _model(**knobs) -> CausalLM:
    return CausalLM(ModelConfig(**TINY, **knobs), seed=3)


# -- init ---------------------------------------------------------------------------------------------------
def test_small_init_embedding_std_and_deepnorm_betas():
    big = dict(TINY, dim=256, n_heads=4, vocab_size=4096)
    small = CausalLM(
        ModelConfig(**big, init="small_init", embedding_init_std=0.1), seed=0
    ).state_dict()
    std = math.sqrt(2 / (5 * 256))
    assert small["layers.1.attention.wq.weight"].std().item() == pytest.approx(std, rel=0.03)
    assert small["layers.1.attention.wo.weight"].std().item() == pytest.approx(
        std / math.sqrt(4), rel=0.03
    )
    assert small["layers.0.tok_embeddings.weight"].std().item() == pytest.approx(0.1, rel=0.03)

    deep_cfg = ModelConfig(**big, norm_placement="post", deepnorm=True)
    deep = CausalLM(deep_cfg, seed=0).state_dict()
    beta = 0.02 * deepnorm_beta(deep_cfg)
    assert deepnorm_beta(deep_cfg) == pytest.approx((8 * 2) ** -0.25)
    k, v = deep["layers.1.attention.wkv.weight"]
    assert k.std().item() == pytest.approx(0.02, rel=0.03) and v.std().item() == pytest.approx(
        beta, rel=0.03
    )
    for name in ("attention.wo.weight", "feed_forward.w13.weight", "feed_forward.w2.weight"):
        assert deep[f"layers.1.{name}"].std().item() == pytest.approx(beta, rel=0.03), name
    assert deep["layers.1.attention.wq.weight"].std().item() == pytest.approx(0.02, rel=0.03)


def test_the_default_model_is_unchanged_by_the_knobs_code():
    """Same seed, default knobs: the draw of every tensor is what it was (embedding std = init_std, etc.)."""
    plain, explicit = _model(), _model(embedding_init_std=0.02, norm_placement="pre")
    for (name, a), b in zip(plain.state_dict().items(), explicit.state_dict().values()):
        assert torch.equal(a, b), name


# -- block semantics ------------------------------------------------------------------------------------------
def _block_io(**knobs):
    model = _model(**knobs).eval()
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0))
    block = model.layers[1]
    return block, x, block(x)


def test_post_norm_and_deepnorm_semantics():
    block, x, y = _block_io(norm_placement="post", deepnorm=True)
    alpha = deepnorm_alpha(ModelConfig(**TINY))
    assert alpha == pytest.approx(4**0.25)
    h = block.attention_norm(alpha * x + block.attention(x))
    assert torch.allclose(y, block.ffn_norm(alpha * h + block.feed_forward(h)), atol=1e-6)
    block, x, y = _block_io(norm_placement="post")
    h = block.attention_norm(x + block.attention(x))
    assert torch.allclose(y, block.ffn_norm(h + block.feed_forward(h)), atol=1e-6)


def test_sandwich_norm_semantics():
    block, x, y = _block_io(norm_placement="sandwich")
    h = x + block.attention_out_norm(block.attention(block.attention_norm(x)))
    assert torch.allclose(
        y, h + block.ffn_out_norm(block.feed_forward(block.ffn_norm(h))), atol=1e-6
    )


def test_qk_norm_normalizes_each_heads_q_and_k():
    block, x, _ = _block_io(qk_norm=True)
    attention = block.attention
    with torch.no_grad():
        attention.q_norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    seen = {}
    attention.q_norm.register_forward_hook(lambda _m, _a, out: seen.setdefault("q", out))
    attention(x)
    q = attention.wq(x).view(2, 7, 4, 8)
    want = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-5) * attention.q_norm.weight
    assert torch.allclose(seen["q"], want, atol=1e-6)


def test_knob_choices_are_checked_in_one_line():
    with pytest.raises(
        ConfigError, match="model.deepnorm: DeepNet is post-norm; set model.norm_placement: post"
    ):
        validate_model(ModelConfig(**TINY, deepnorm=True))
    with pytest.raises(ConfigError, match="model.norm_placement: expected"):
        validate_model(ModelConfig(**TINY, norm_placement="middle"))
    with pytest.raises(ConfigError, match="model.embedding_init_std"):
        validate_model(ModelConfig(**TINY, embedding_init_std=-1.0))


def test_hf_llama_refuses_what_it_cannot_express():
    assert (
        llama_cannot_express(ModelConfig(**TINY, init="small_init", embedding_init_std=0.1)) == ""
    )
    for knobs, named in [
        (dict(qk_norm=True), "model.qk_norm=true"),
        (dict(norm_placement="sandwich"), "model.norm_placement=sandwich"),
        (dict(norm_placement="post", deepnorm=True), "model.deepnorm=true"),
    ]:
        assert named in llama_cannot_express(ModelConfig(**TINY, **knobs))


# -- the attention-logit probe ----------------------------------------------------------------------------------
def _brute_max_logit(q, k, mask=None):
    rep = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(rep, dim=1).transpose(-1, -2) / q.shape[-1] ** 0.5
    s = q.shape[2]
    allowed = torch.ones(s, s, dtype=torch.bool).tril() if mask is None else mask
    return scores.masked_fill(~allowed, float("-inf")).max()


@pytest.mark.parametrize("block_elements", [1 << 24, 40])  # one block; a few query rows per block
def test_probe_equals_the_brute_force_maximum(monkeypatch, block_elements):
    monkeypatch.setattr("keel.model.layers.PROBE_BLOCK_ELEMENTS", block_elements)
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 9, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen)
    k[:, :, -1] = 50.0  # the last key dominates, but only the last query may attend it
    out = torch.full((), float("-inf"))
    record_max_logit(out, q, k, None)
    assert out.item() == pytest.approx(_brute_max_logit(q, k).item(), rel=1e-6)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    mask[5:, :5] = False  # two documents
    mask = mask.expand(2, 1, 9, 9)
    out = torch.full((), float("-inf"))
    record_max_logit(out, q, k, mask)
    assert out.item() == pytest.approx(_brute_max_logit(q, k, mask).item(), rel=1e-6)


def test_monitor_records_the_largest_logit_of_its_batch():
    """The recorded maximum equals max(QKᵀ/√d) recomputed from each attention's q and k on that batch."""
    model = _model(qk_norm=True)
    monitor = ModelMonitor(model, Topology.from_env(), interval=1)
    tokens = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(2))
    qk = {}

    def spy(i):
        def hook(module, args, _out):
            x = args[0]
            b, s, _ = x.shape
            q = module.q_norm(module.wq(x).view(b, s, -1, 8)).transpose(1, 2)
            k = module.k_norm(module._kv(x)[0].view(b, s, -1, 8)).transpose(1, 2)
            cos, sin = module.rotary(q)
            rot = lambda t: t * cos + torch.cat((-t[..., 4:], t[..., :4]), -1) * sin  # noqa: E731
            qk[i] = (rot(q), rot(k))

        return hook

    for i, block in enumerate(model.layers[1:3]):
        block.attention.register_forward_hook(spy(i))
    monitor.arm(1)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    monitor.before_step(1)
    got = monitor.after_step(1)
    for i in range(2):
        want = _brute_max_logit(*[t.detach() for t in qk[i]]).item()
        assert got[f"attn/block{i}/max_logit"] == pytest.approx(want, rel=1e-5)
    assert all(a.logit_probe is None for a in (b.attention for b in model.layers[1:3]))  # disarmed


def test_the_warning_fires_once_per_layer(tmp_path):
    warning = AttentionLogitWarning(
        StabilityConfig(attn_logit_warn=100.0, attn_logit_growth=10.0), AnomalyLog(tmp_path, 0)
    )
    assert (
        warning.check(50, {"attn/block0/max_logit": 5.0, "attn/block1/max_logit": 2.0, "loss": 3.0})
        == []
    )
    assert warning.check(100, {"attn/block0/max_logit": 150.0, "attn/block1/max_logit": 21.0}) == [
        "block0",
        "block1",
    ]
    assert warning.check(150, {"attn/block0/max_logit": 900.0, "attn/block1/max_logit": 90.0}) == []
    events = read_anomalies(tmp_path)
    assert [(e["kind"], e["step"], e["layer"]) for e in events] == [
        ("attention_logits", 100, "block0"),
        ("attention_logits", 100, "block1"),
    ]
    assert (
        "above stability.attn_logit_warn=100" in events[0]["reason"]
        and "10.5x" in events[1]["reason"]
    )


# -- every layout trains like one process ---------------------------------------------------------------------------
# qk-norm, sandwich norms, small-init and the embedding's own std together; DeepNet (post-norm) separately
KNOBS = dict(
    model__qk_norm="true",
    model__norm_placement="sandwich",
    model__init="small_init",
    model__embedding_init_std=0.05,
)
DEEPNORM = dict(model__norm_placement="post", model__deepnorm="true")
LAYOUTS = {
    "tp2-sp": dict(parallel__tp=2, parallel__sequence_parallel="true"),
    "pp2": dict(parallel__pp=2),
    "sp2": dict(parallel__sp=2),
}
# a high LR, so attention logits grow without QK-norm; the monitor samples every 5th step
HOT = dict(
    train__lr=0.05,
    train__steps=30,
    stability__monitor_interval=5,
    stability__attn_logit_warn=15,
    stability__spike="false",
    stability__max_nonfinite=30,
)
KEEL_RUNS = [
    Run.of("knobs", 1, **KNOBS),
    Run.of("deepnorm", 1, **DEEPNORM),
    Run.of("hot", 1, **HOT),
    Run.of("hot-qk-norm", 1, model__qk_norm="true", **HOT),
]
KEEL_RUNS += [Run.of(f"knobs-{name}", 2, **KNOBS, **layout) for name, layout in LAYOUTS.items()]
KEEL_RUNS += [
    Run.of(f"deepnorm-{name}", 2, **DEEPNORM, **LAYOUTS[name]) for name in ("tp2-sp", "pp2")
]


def _metrics(run_dir):
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_knobs_train_like_one_process_at_every_layout(runs, layout):
    reference = _metrics(runs.get("knobs", 1, **KNOBS))
    got = _metrics(runs.get(f"knobs-{layout}", 2, **KNOBS, **LAYOUTS[layout]))
    assert_close([r["loss"] for r in got], [r["loss"] for r in reference], 1e-5)
    assert_grad_norms_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in reference])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
def test_deepnorm_trains_like_one_process(runs, layout):
    reference = _metrics(runs.get("deepnorm", 1, **DEEPNORM))
    got = _metrics(runs.get(f"deepnorm-{layout}", 2, **DEEPNORM, **LAYOUTS[layout]))
    assert_close([r["loss"] for r in got], [r["loss"] for r in reference], 1e-5)
    assert_grad_norms_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in reference])


@pytest.mark.slow
def test_attention_logits_warn_without_qk_norm_and_not_with_it(runs):
    without, with_norm = (
        runs.get("hot", 1, **HOT),
        runs.get("hot-qk-norm", 1, model__qk_norm="true", **HOT),
    )
    peaks = {}
    for name, run_dir in (("without", without), ("with", with_norm)):
        logits = [v for r in _metrics(run_dir) for k, v in r.items() if k.endswith("/max_logit")]
        assert logits, name
        peaks[name] = max(logits)
    warned = [e for e in read_anomalies(without) if e["kind"] == "attention_logits"]
    assert warned and {e["layer"] for e in warned} <= {"block0", "block1"}
    assert len({e["layer"] for e in warned}) == len(warned)  # once per layer
    assert not [e for e in read_anomalies(with_norm) if e["kind"] == "attention_logits"]
    assert peaks["without"] > 15 > peaks["with"], peaks  # measured: 34.6 and 4.4
