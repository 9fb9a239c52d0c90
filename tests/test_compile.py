"""model.compile: each block compiled in place gives the eager model's losses and gradients, under the same names.

The multi-process run (2 ranks, ZeRO-1) is tests/test_train_equivalence.py::test_compiled_blocks_train_like_eager.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from keel.config import ConfigError, ModelConfig, ParallelConfig, RunConfig, validate
from keel.engine.ds_config import resolve_ds_config
from keel.model import CausalLM, compile_blocks

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, dropout=0.0)


def _train(compiled: bool, steps: int = 3) -> tuple[list[float], list[torch.Tensor], list[str]]:
    model = CausalLM(CFG, seed=0)
    if compiled:
        compile_blocks(model.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(
        0, CFG.vocab_size, (steps, 4, 33), generator=torch.Generator().manual_seed(0)
    )
    losses, grads = [], []
    for batch in data:
        optimizer.zero_grad()
        loss = model(batch[:, :-1], labels=batch[:, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        optimizer.step()
    return losses, grads, sorted(model.state_dict())


def test_compiled_blocks_match_eager():
    eager_losses, eager_grads, eager_names = _train(compiled=False)
    losses, grads, names = _train(compiled=True)
    assert names == eager_names  # Module.compile: no `_orig_mod.` wrapper in checkpoints
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=0)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize(
    "parallel, model, named",
    [
        (dict(tp=2), {}, "parallel.tp"),
        (dict(pp=2), {}, "parallel.pp"),
        (dict(sp=2), {}, "parallel.sp"),
        ({}, dict(moe_experts=4), "model.moe_experts"),
    ],
)
def test_compile_refuses_what_it_is_not_proven_on(parallel, model, named):
    cfg = RunConfig(
        model=dataclasses.replace(CFG, compile=True, **model), parallel=ParallelConfig(**parallel)
    )
    with pytest.raises(ConfigError, match=rf"model\.compile: .*{named}"):
        validate(cfg, world_size=2)


def test_compile_refuses_zero3():
    cfg = RunConfig(model=dataclasses.replace(CFG, compile=True))
    with pytest.raises(ConfigError, match="stage=3 with model.compile"):
        resolve_ds_config({"zero_optimization": {"stage": 3}}, cfg, dp_size=2)


def test_build_model_compiles_the_blocks_when_asked():
    """The run's model (keel/engine/build.py build_model) runs its blocks through dynamo when model.compile is
    set, and eagerly otherwise: a hook inside a block sees `torch.compiler.is_compiling()` only in the former."""
    from keel.engine.build import build_model

    for compiled in (True, False):
        model = build_model(RunConfig(model=dataclasses.replace(CFG, compile=compiled)))
        seen: list[bool] = []
        model.layers[1].attention.register_forward_pre_hook(
            lambda m, a, seen=seen: seen.append(torch.compiler.is_compiling())
        )
        model(torch.zeros(1, 8, dtype=torch.long))
        assert seen == [compiled]


def test_auto_compiles_only_where_it_was_measured_to_win(monkeypatch):
    """model.compile=auto: on the CPU, fp32, dense tp = pp = sp = 1 at ZeRO 0-2, dim >= 256, >= 1000 steps;
    eager elsewhere, naming why; explicit true/false win over the policy; a bad value is one line."""
    from keel.config import TrainConfig, build_config
    from keel.engine.compile_policy import should_compile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    big = dataclasses.replace(CFG, dim=256, compile="auto")
    long_run = TrainConfig(steps=1000)
    assert should_compile(RunConfig(model=big, train=long_run), 1, "fp32")[0]
    for cfg, stage, precision, why in [
        (RunConfig(model=big, train=TrainConfig(steps=300)), 1, "fp32", "train.steps < 1000"),
        (
            RunConfig(model=dataclasses.replace(big, dim=128), train=long_run),
            1,
            "fp32",
            "model.dim < 256",
        ),
        (RunConfig(model=big, train=long_run), 3, "fp32", "ZeRO-3"),
        (RunConfig(model=big, train=long_run), 1, "bf16", "bf16"),
        (
            RunConfig(model=big, train=long_run, parallel=ParallelConfig(tp=2)),
            1,
            "fp32",
            "parallel.tp",
        ),
    ]:
        compiled, reason = should_compile(cfg, stage, precision)
        assert not compiled and why in reason, reason
    assert should_compile(RunConfig(model=dataclasses.replace(CFG, compile="true")), 1, "fp32") == (
        True,
        "model.compile=true",
    )
    assert not should_compile(
        RunConfig(model=dataclasses.replace(big, compile=False), train=long_run), 1, "fp32"
    )[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "CUDA" in should_compile(RunConfig(model=big, train=long_run), 1, "fp32")[1]
    # YAML's boolean, read as a setting
    assert build_config({"model": {"compile": True}}).model.compile == "True"
    with pytest.raises(ConfigError, match="model.compile: expected auto, true or false"):
        validate(build_config({"model": {"compile": "sometimes"}}), 1)
