"""The activation count (keel/engine/activations.py) against what torch keeps: every tensor autograd saves in a
forward (saved-tensor hooks; one count per storage, parameters left out), on CPU, at micro-batch 1 and 2, and
for one rank's tensor-parallel shard of a block."""

from __future__ import annotations

import pytest
import torch

from keel.config import ModelConfig
from keel.engine.activations import ActivationShape, block_bytes, head_bytes
from keel.model import CausalLM
from keel.model.llama import Block
from keel.parallel import comm
from keel.parallel.layer_parallel import EPContext, LayerParallel
from keel.parallel.tensor import TPContext

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BASE = dict(vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, compile="false")


def saved_bytes(module: torch.nn.Module, run) -> int:
    """Bytes of the distinct storages autograd saves while `run()` runs, parameters excepted."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(seen.values())


CASES = {
    "mha": dict(n_kv_heads=8),
    "gqa": {},
    "qk_norm": dict(qk_norm=True),
    "moe": dict(moe_experts=4, moe_top_k=2),
    "moe_shared": dict(moe_experts=4, moe_top_k=1, moe_shared_expert=True),
}


def tp_shard(tp: int) -> LayerParallel:
    """Rank 0 of `tp`'s layers with inert collectives (no process group: what a shard saves does not depend on
    what its all-reduces move)."""
    group = comm.Group("tp", tuple(range(tp)), 0, comm.DEVICE)
    return LayerParallel(tp=TPContext(group, 0, tp), ep=EPContext(rank=0, size=1, ranks=(0,)))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("micro_batch", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_blocks_activations_are_what_torch_saves(case, micro_batch, precision, tp):
    """Within 5 %. Dense blocks come within 3 % at every tp (what is left is RoPE's cos/sin tables, one pair per
    model, shared by its blocks); an MoE block's bf16 tp4 shard is 3.2 % over, not accounted for yet."""
    cfg = ModelConfig(**{**BASE, **CASES[case]})
    torch.manual_seed(0)
    block = Block(cfg, 0, tp_shard(tp)).to(DTYPES[precision])
    x = torch.randn(micro_batch, 128, cfg.dim, dtype=DTYPES[precision], requires_grad=True)
    measured = saved_bytes(block, lambda: block(x))
    predicted = block_bytes(
        cfg, ActivationShape(micro_batch, 128, precision, tp=tp), moe="moe" in case
    )
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)


@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_a_whole_models_activations_are_what_torch_saves(micro_batch, precision):
    cfg = ModelConfig(**BASE)
    torch.manual_seed(0)
    model = CausalLM(cfg, seed=0).to(DTYPES[precision])
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, 129))
    measured = saved_bytes(model, lambda: model(tokens[:, :-1], tokens[:, 1:]))
    shape = ActivationShape(micro_batch, 128, precision)
    predicted = cfg.n_layers * block_bytes(cfg, shape) + head_bytes(
        cfg, shape, cfg.vocab_size, fused_loss=False
    )
    assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured)
