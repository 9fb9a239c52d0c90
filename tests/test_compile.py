"""model.compile: each block compiled in place gives the eager model's losses and gradients, under the same names.

The multi-process run (2 ranks, ZeRO-1) is tests/test_train_equivalence.py::test_compiled_blocks_train_like_eager.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from keel.config import ConfigError, ModelConfig, ParallelConfig, RunConfig, validate
from keel.model import CausalLM, compile_blocks
from keel.training.ds_config import resolve_ds_config

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, dropout=0.0)


def _train(compiled: bool, steps: int = 3) -> tuple[list[float], list[torch.Tensor], list[str]]:
    model = CausalLM(CFG, seed=0)
    if compiled:
        compile_blocks(model.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, CFG.vocab_size, (steps, 4, 33), generator=torch.Generator().manual_seed(0))
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


@pytest.mark.parametrize("parallel, model, named", [
    (dict(tp=2), {}, "parallel.tp"), (dict(pp=2), {}, "parallel.pp"), (dict(sp=2), {}, "parallel.sp"),
    ({}, dict(moe_experts=4), "model.moe_experts")])
def test_compile_refuses_what_it_is_not_proven_on(parallel, model, named):
    cfg = RunConfig(model=dataclasses.replace(CFG, compile=True, **model), parallel=ParallelConfig(**parallel))
    with pytest.raises(ConfigError, match=rf"model\.compile: .*{named}"):
        validate(cfg, world_size=2)


def test_compile_refuses_zero3():
    cfg = RunConfig(model=dataclasses.replace(CFG, compile=True))
    with pytest.raises(ConfigError, match="stage=3 with model.compile"):
        resolve_ds_config({"zero_optimization": {"stage": 3}}, cfg, dp_size=2)


def test_build_model_compiles_the_blocks_when_asked():
    """The run's model (keel/training/engine.py build_model) runs its blocks through dynamo when model.compile is
    set, and eagerly otherwise: a hook inside a block sees `torch.compiler.is_compiling()` only in the former."""
    from keel.training.engine import build_model

    for compiled in (True, False):
        model = build_model(RunConfig(model=dataclasses.replace(CFG, compile=compiled)))
        seen: list[bool] = []
        model.layers[1].attention.register_forward_pre_hook(
            lambda m, a, seen=seen: seen.append(torch.compiler.is_compiling()))
        model(torch.zeros(1, 8, dtype=torch.long))
        assert seen == [compiled]
