"""`model.fp8`: each recipe's GEMMs against high precision, torchao's own numerics, and tensor parallelism that
changes nothing (each scale taken over the whole logical tensor) — real processes over gloo for the last."""

from __future__ import annotations

import copy
import dataclasses
import math
import os

import pytest
import torch
import torch.distributed as dist

from keel.adapters import torchao_internals
from keel.config import FP8_RECIPES, ConfigError, ModelConfig, validate_model
from keel.launcher.local import free_port
from keel.model import CausalLM
from keel.model.precision import fp8_blocks, fp8_line
from keel.parallel import comm, float8
from keel.parallel.float8 import Float8Spec
from keel.parallel.layer_parallel import LayerParallel
from keel.parallel.topology import Topology
from tests.spawned import start_world

pytestmark = pytest.mark.skipif(
    torchao_internals.problem() is not None, reason=f"{torchao_internals.problem()}"
)
RECIPES = [r for r in FP8_RECIPES if r != "off"]
FP8 = ("tensorwise", "rowwise", "rowwise_gw_hp")
# mantissa bits of each element format: a value rounded to nearest is off by at most 2^-(bits + 1) of itself
MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2, "e2m1": 1}


def _unit_roundoff(recipe: str, which: str) -> float:
    """Relative rounding error bound of the element format `recipe` casts `which` operand to."""
    if recipe == "mxfp4":
        return 2.0 ** -(MANTISSA["e2m1"] + 1)
    if recipe == "mxfp8":
        return 2.0 ** -(MANTISSA[torch.float8_e4m3fn] + 1)
    config, _ = Float8Spec(recipe).torchao_config()
    cast = {
        "out": (config.cast_config_input, config.cast_config_weight),
        "grad_x": (config.cast_config_grad_output, config.cast_config_weight_for_grad_input),
        "grad_w": (
            config.cast_config_grad_output_for_grad_weight,
            config.cast_config_input_for_grad_weight,
        ),
    }[which]
    disabled = torchao_internals.get("ScalingType").DISABLED
    return math.hypot(
        *(
            0.0 if c.scaling_type is disabled else 2.0 ** -(MANTISSA[c.target_dtype] + 1)
            for c in cast
        )
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", [(3, 7, 64, 96), (1, 32, 160, 32)])
def test_each_recipe_is_within_its_formats_rounding_of_high_precision(recipe, shape):
    """Output, input gradient and weight gradient of x Wᵀ against fp32, on odd token counts (MX: whole blocks
    along each reduction axis, so the token count is a multiple of 32 there): within the two operands' unit
    roundoffs combined, and not exact (the casts happened)."""
    b, s, k, n = shape
    if recipe.startswith("mx") and (b * s) % 32:
        s = 32
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, k, generator=gen, requires_grad=True)
    w = torch.randn(n, k, generator=gen, requires_grad=True)
    g = torch.randn(b, s, n, generator=gen)
    y = float8.linear(x, w, Float8Spec(recipe))
    y.backward(g)
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = ref_x @ ref_w.t()
    ref.backward(g)
    for got, want, which in (
        (y, ref, "out"),
        (x.grad, ref_x.grad, "grad_x"),
        (w.grad, ref_w.grad, "grad_w"),
    ):
        bound = _unit_roundoff(recipe, which)
        err = _rel(got, want)
        assert err <= bound, f"{which}: relative error {err:.4f} > {bound:.4f}"
        if bound:
            assert err > 0, f"{which}: equal to fp32: no cast happened"


@pytest.mark.parametrize("recipe", FP8)
def test_fp8_recipes_are_torchaos_own_numerics(recipe):
    """One process, no groups: bitwise what torchao's Float8Linear computes for the same recipe."""
    from torchao.float8 import convert_to_float8_training

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 48, generator=gen, requires_grad=True)
    lin = torch.nn.Linear(48, 80, bias=False)
    ref = torch.nn.Sequential(copy.deepcopy(lin))
    config, _ = Float8Spec(recipe).torchao_config()
    convert_to_float8_training(ref, config=dataclasses.replace(config, emulate=True))
    ref_x = x.detach().clone().requires_grad_()
    y, ref_y = float8.linear(x, lin.weight, Float8Spec(recipe)), ref(ref_x)
    g = torch.randn(y.shape, generator=gen)
    y.backward(g)
    ref_y.backward(g)
    assert torch.equal(y, ref_y)
    assert torch.equal(x.grad, ref_x.grad)
    assert torch.equal(lin.weight.grad, ref[0].weight.grad)


def test_fp8_layers_and_the_startup_line():
    cfg = ModelConfig(n_layers=6, fp8="rowwise", fp8_skip_blocks=1)
    assert list(fp8_blocks(cfg)) == [1, 2, 3, 4]
    model = CausalLM(dataclasses.replace(cfg, vocab_size=64))
    specs = {name: module.fp8 for name, module in model.named_modules() if hasattr(module, "fp8")}
    fp8_names = {name for name, spec in specs.items() if spec is not None}
    assert fp8_names == {
        f"layers.{i + 1}.{sub}"
        for i in range(1, 5)
        for sub in (
            "attention.wq",
            "attention.wkv",
            "attention.wo",
            "feed_forward.w13",
            "feed_forward.w2",
        )
    }
    assert (
        len(specs) == 6 * 5
    )  # every block's five linears have the attribute; the head and embedding none
    line = fp8_line(cfg)
    assert line.startswith("fp8 rowwise (emulated): blocks 1-4 wq/wkv/wo/w13/w2;"), line
    assert (
        "high precision: embedding, output head, norms, blocks 0,5 (model.fp8_skip_blocks)" in line
    )
    assert fp8_line(ModelConfig()) is None
    moe = fp8_line(dataclasses.replace(cfg, moe_experts=4, moe_shared_expert=True))
    assert "wq/wkv/wo/w13/w2, the shared expert; high precision: " in moe
    assert "router, routed experts" in moe
    # tp > kv heads: wkv is replicated and its gradients partial, so it stays in high precision (and says so)
    replicated = fp8_line(dataclasses.replace(cfg, n_kv_heads=2), tp=4)
    assert "blocks 1-4 wq/wo/w13/w2;" in replicated
    assert "wkv (kv heads replicated over tp=4)" in replicated
    with pytest.raises(ConfigError, match="model.fp8_skip_blocks"):
        validate_model(ModelConfig(n_layers=2, fp8="tensorwise", fp8_skip_blocks=1))
    with pytest.raises(ConfigError, match="model.fp8"):
        validate_model(ModelConfig(fp8="fp8"))


# head_dim 32 and ffn 256: every shard at tp 2 holds whole 32-element MX blocks
CFG = dict(
    vocab_size=200,
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden=256,
    vocab_pad_multiple=16,
)


def _full_grad(param: torch.nn.Parameter, parallel: LayerParallel) -> torch.Tensor:
    """The whole model's gradient: summed over the ranks splitting a sequence (cp), gathered over tp."""
    grad = param.grad
    if parallel.seq.size > 1:
        grad = comm.all_reduce(grad.clone(), parallel.seq.group)
    if not getattr(param, "tensor_model_parallel", False):
        return grad
    return torch.cat(comm.all_gather(grad, parallel.tp.group), dim=param.partition_dim)


def _tp_worker(
    rank: int,
    world: int,
    port: int,
    recipe: str,
    kv_heads: int,
    sp: bool,
    local: bool,
    axis: str = "tp",
) -> None:
    """`axis`=`world` (tp, or context parallel cp) FP8 model against the one-process FP8 model: loss and every
    gathered gradient. `local`: the scales of each rank's shard alone (the reductions removed), which must NOT
    match."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = ModelConfig(**{**CFG, "n_kv_heads": kv_heads, "fp8": recipe})
        parallel = LayerParallel.from_topology(Topology.from_env(**{axis: world}), sp, seed=7)
        if local:
            for_group = float8._Casts.__init__

            def no_groups(self, spec, groups, *rest):
                for_group(self, spec, {}, *rest)

            float8._Casts.__init__ = no_groups
        model = CausalLM(cfg, seed=3, parallel=parallel)
        reference = CausalLM(cfg, seed=3)
        gen = torch.Generator().manual_seed(11)
        tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=gen)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        ref_loss = reference(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        ref_loss.backward()
        ref_params = dict(reference.named_parameters())
        worst = abs(loss.item() - ref_loss.item()) / ref_loss.item()
        for name, param in model.named_parameters():
            want, got = ref_params[name].grad, _full_grad(param, parallel)
            rows = min(want.shape[0], got.shape[0])
            worst = max(worst, _rel(got[:rows], want[:rows]))
        if local:
            assert worst > 1e-3, (
                f"per-shard scales gave tp=1's result ({worst:.2e}): the test is blind"
            )
        else:
            assert worst < 1e-5, f"{axis}={world} FP8 differs from one process's FP8 by {worst:.2e}"
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, world, kv_heads, sp, local, axis",
    [
        ("tensorwise", 2, 2, False, False, "tp"),
        ("tensorwise", 2, 2, True, False, "tp"),  # + Megatron sequence parallel
        ("rowwise", 2, 2, True, False, "tp"),
        ("rowwise_gw_hp", 2, 2, False, False, "tp"),
        ("mxfp8", 2, 2, False, False, "tp"),  # blocks of 32 within each shard: no reduction needed
        # context parallel: each rank's tokens are part of every token-axis scale (reduced over cp)
        ("tensorwise", 2, 2, False, False, "cp"),
        ("rowwise", 2, 2, False, False, "cp"),
        # without the amax reductions tensorwise tp=2 is another model. (Rowwise scales are powers of two, and
        # a scale twice another rounds the same mantissas: there a shard's own scale differs only where values
        # fall below e4m3's normal range.)
        ("tensorwise", 2, 2, False, True, "tp"),
        ("tensorwise", 2, 2, False, True, "cp"),
    ],
)
def test_tensor_parallel_fp8_equals_one_process_fp8(recipe, world, kv_heads, sp, local, axis):
    start_world(_tp_worker, (world, free_port(), recipe, kv_heads, sp, local, axis), world)


def test_a_missing_torchao_piece_is_named_in_one_line(monkeypatch):
    """An upgrade that moved one of the internals Keel reads fails with its name, not deep in a forward."""
    monkeypatch.setattr(
        torchao_internals,
        "INTERNALS",
        [*torchao_internals.INTERNALS, ("torchao.float8", "NoSuchThing")],
    )
    torchao_internals._load.cache_clear()
    try:
        assert torchao_internals.problem() == (
            "the installed torchao has no torchao.float8.NoSuchThing (AttributeError), which Keel's FP8 "
            "path needs: pip install 'keel[fp8]'"
        )
    finally:
        monkeypatch.undo()
        torchao_internals._load.cache_clear()
    assert torchao_internals.problem() is None


def test_fp8_without_torchao_stops_before_launch(monkeypatch, tmp_path):
    from keel.launcher.run_spec import build_run

    monkeypatch.setattr(
        torchao_internals, "problem", lambda: "torchao is not installed: pip install 'keel[fp8]'"
    )
    with pytest.raises(ConfigError) as err:
        build_run(None, ["model.fp8=rowwise"], None, str(tmp_path / "run"), 1)
    assert str(err.value) == (
        "model.fp8=rowwise: torchao is not installed: pip install 'keel[fp8]', or set model.fp8=off"
    )
    build_run(None, ["model.fp8=off"], None, str(tmp_path / "run"), 1)  # off needs no torchao


def test_mx_blocks_must_fit_every_shard():
    from keel.config import RunConfig, validate

    cfg = RunConfig()
    cfg.model.fp8 = "mxfp8"
    validate(cfg, 1)  # the default model: dim 128, head_dim 32, ffn 352, 4 × 128 tokens
    cfg.parallel.tp = 2
    with pytest.raises(ConfigError, match="the feed-forward width per tp rank is 176"):
        validate(cfg, 2)


@pytest.mark.slow  # dynamo's tracing: ~10 s a recipe on 2 cores; rowwise takes tensorwise's path
@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_an_fp8_block_traces_as_one_graph_and_computes_what_eager_does(recipe):
    """model.compile: the FP8 casts, amax reductions and GEMMs trace without a graph break (torchao's pieces are
    resolved when the block is built), and the traced block's output and input gradient equal eager's."""
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=2, fp8=recipe)
    block = CausalLM(cfg).layers[1]
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert torch._dynamo.explain(block)(x).graph_break_count == 0
    y = block(x)
    y.sum().backward()
    eager_grad, x.grad = x.grad, None
    traced = torch.compile(block, backend="aot_eager")(x)
    traced.sum().backward()
    assert torch.equal(traced, y) and torch.equal(x.grad, eager_grad)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8", "mxfp4"])
def test_the_probe_sees_an_outlier_flatten_its_operand(recipe):
    """An outlier in every row (the rows' scale, and the first MX block of each) pushes that scale's other values
    under the format's normal range: the probe's underflow rises for the input, not for the clean weight. mxfp4
    has one mantissa bit and 2.6 normal binades: ~40% of a clean block is below its normal range already."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=gen)
    w = torch.randn(32, 64, generator=gen)
    clean, spiked = float8.new_probe("cpu"), float8.new_probe("cpu")
    float8.linear(x, w, Float8Spec(recipe), probe=clean)
    x[:, 0] *= 1e5
    float8.linear(x, w, Float8Spec(recipe), probe=spiked)
    x_row, w_row = float8.PROBE_ROLES.index("x"), float8.PROBE_ROLES.index("w")
    underflow = float8.PROBE_STATS.index("underflow")
    if recipe != "mxfp4":
        assert clean[x_row, underflow] < 0.01 and clean[w_row, underflow] < 0.01, clean
    assert spiked[x_row, underflow] > clean[x_row, underflow] + 0.25, (clean, spiked)
    assert spiked[w_row, underflow] == clean[w_row, underflow]
    assert (spiked[:, float8.PROBE_STATS.index("saturated")] == 0).all()
