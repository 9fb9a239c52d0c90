"""Initialisation by row blocks: every tp shard is a slice of the tp=1 weights, and temporaries stay bounded."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

from keel.config import ModelConfig
from keel.model import CausalLM, build_layers
from keel.model.init import INIT_BLOCK_BYTES, block_rows, fill_shard_
from keel.model.materialize import Placement
from keel.parallel.layer_parallel import LayerParallel
from keel.parallel.tensor import FusedColumnParallelLinear, TPContext, mark_sharded

CFG = dict(
    vocab_size=200,
    dim=64,
    n_layers=2,
    n_heads=8,
    n_kv_heads=2,
    vocab_pad_multiple=16,
    tie_embeddings=False,
)


@pytest.mark.parametrize("init", ["normal", "truncated_normal"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shards_are_slices_of_the_tp1_weights(tp_size, init):
    """Built in one process: each rank's shard equals its slice of tp=1's (kv heads split at 2, replicated at 4)."""
    cfg = ModelConfig(**CFG, init=init)
    reference = dict(CausalLM(cfg, seed=9).named_parameters())
    for rank in range(tp_size):
        model = CausalLM(
            cfg, seed=9, parallel=LayerParallel.without_groups(tp=tp_size, tp_rank=rank)
        )
        for name, param in model.named_parameters():
            full = reference[name]
            dim = getattr(param, "partition_dim", None)
            if dim is None or param.tp_size == 1:
                rows = min(full.shape[0], param.shape[0])
                assert torch.equal(param[:rows], full[:rows]), name
                continue
            width = param.shape[dim]
            start = rank * width
            # vocabulary rows: padding past vocab_size is zero
            if "tok_embeddings" in name or "output" in name:
                real = max(0, min(width, cfg.vocab_size - start))
                assert torch.equal(param[:real], full[start : start + real]), name
                assert param[real:].abs().sum() == 0, name
            else:
                assert torch.equal(param, full.narrow(dim, start, width)), name


def _mib_matrix(
    rows: int, cols: int, dim: int | None, tp_size: int = 2, rank: int = 1
) -> torch.nn.Parameter:
    shape = [rows, cols]
    if dim is not None:
        shape[dim] //= tp_size
    param = torch.nn.Parameter(torch.empty(shape))
    if dim is not None:
        mark_sharded(param, dim, (rows, cols), TPContext(rank=rank, size=tp_size))
    return param


class _LargestTemporary(TorchFunctionMode):
    """The largest tensor a torch call returns that is not a view of `param` (the init's temporaries)."""

    def __init__(self, param: torch.Tensor):
        super().__init__()
        self.param_storage = param.untyped_storage().data_ptr()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() != self.param_storage:
            self.largest = max(self.largest, out.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("dim", [None, 0, 1], ids=["whole", "column-parallel", "row-parallel"])
def test_init_temporaries_do_not_grow_with_the_tensor(dim):
    """A 64 MiB matrix and a 16× smaller one need the same temporary: one block of ≤ INIT_BLOCK_BYTES."""
    largest = []
    for rows in (512, 8192):
        param = _mib_matrix(rows, 2048, dim)
        with torch.no_grad(), _LargestTemporary(param) as mode:
            fill_shard_(param, 0.02, False, seed=0, index=1, name="w")
        assert param.abs().sum() > 0
        largest.append(mode.largest)
    assert largest[0] == largest[1] <= INIT_BLOCK_BYTES
    assert largest[1] < 8192 * 2048 * 4 // 8  # far below the whole tensor (which the old init drew)


def test_blocks_depend_on_the_logical_shape_only():
    assert block_rows((32000, 2048)) == INIT_BLOCK_BYTES // (4 * 2048)
    assert block_rows((10, 2**21)) == 1  # a row wider than the block is drawn alone


def test_meta_build_gives_the_eager_buffers():
    """Buffers built on meta come back as zeros: that must be what an eager build has (MoE balance bias)."""
    cfg = ModelConfig(**{**CFG, "moe_experts": 4, "moe_every": 1})
    eager = build_layers(cfg)
    meta = Placement().build(lambda: build_layers(cfg))
    for a, b in zip(eager, meta, strict=True):
        buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())
        assert buffers_a.keys() == buffers_b.keys()
        for name, value in buffers_a.items():
            assert torch.equal(value, buffers_b[name]), name
    assert not any(p.is_meta for layer in meta for p in layer.parameters())


def test_meta_build_keeps_ties_and_attributes():
    cfg = ModelConfig(**{**CFG, "tie_embeddings": True})
    model = CausalLM(cfg, seed=0, parallel=LayerParallel.without_groups(tp=2, tp_rank=1))
    embedding, head = model.layers[0].tok_embeddings.weight, model.layers[-1].output.weight
    assert head is embedding and embedding.device.type == "cpu"
    assert embedding.full_shape == (cfg.vocab_size, cfg.dim) and embedding.tp_rank == 1


def test_placement_dtype_gives_the_rounded_fp32_values():
    cfg = ModelConfig(**CFG)
    fp32 = CausalLM(cfg, seed=4)
    bf16 = CausalLM(cfg, seed=4, placement=Placement(dtype=torch.bfloat16))
    for (name, a), b in zip(fp32.named_parameters(), bf16.parameters(), strict=True):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name


def test_moved_expert_keeps_its_values():
    """Experts are keyed by global id: the last expert of ep rank 1 equals expert 3 of the whole model."""
    cfg = dataclasses.replace(ModelConfig(**CFG), moe_experts=4, moe_every=1)
    whole = CausalLM(cfg, seed=2).layers[1].feed_forward.local_experts[3]
    half = CausalLM(cfg, seed=2, parallel=LayerParallel.without_groups(ep=2, ep_rank=1))
    half = half.layers[1].feed_forward.local_experts[1]
    for (name, a), b in zip(whole.named_parameters(), half.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dim", [None, 0, 1])
def test_a_flat_window_is_that_slice_of_the_shard(dim):
    """ZeRO-3 partitions are flat windows of the (tp-shard) parameter, cut anywhere, even mid-row."""
    whole = _mib_matrix(300, 2048, dim)
    with torch.no_grad():
        fill_shard_(whole, 0.02, False, seed=1, index=2, name="w")
        flat = whole.detach().reshape(-1)
        for start, end in [(0, 5000), (4093, 130_001), (flat.numel() - 777, flat.numel())]:
            out = torch.empty(end - start)
            fill_shard_(whole, 0.02, False, seed=1, index=2, name="w", out=out, flat=(start, end))
            assert torch.equal(out, flat[start:end]), (start, end)


def _fused(
    rows: int, cols: int, names: tuple[str, ...], tp_size: int = 2, rank: int = 1
) -> torch.nn.Parameter:
    return FusedColumnParallelLinear(cols, rows, TPContext(rank=rank, size=tp_size), names).weight


def test_a_fused_parameter_draws_each_part_as_the_projection_it_fuses():
    """Part i of a fused shard is exactly the column-parallel shard of a separate tensor named names[i]."""
    fused = _fused(300, 2048, ("gate", "up"))
    with torch.no_grad():
        fill_shard_(fused, 0.02, False, seed=1, index=2, name=fused.part_names)
        for part, name in enumerate(fused.part_names):
            single = _mib_matrix(300, 2048, 0)
            fill_shard_(single, 0.02, False, seed=1, index=2, name=name)
            assert torch.equal(fused[part], single), name
    assert not torch.equal(fused[0], fused[1])


def test_a_flat_window_of_a_fused_parameter_is_that_slice_of_the_shard():
    """A ZeRO-3 window may straddle the parts (each part's shard is one stretch of the flattened shard)."""
    fused = _fused(300, 2048, ("gate", "up"))
    with torch.no_grad():
        fill_shard_(fused, 0.02, False, seed=1, index=2, name=fused.part_names)
        flat = fused.detach().reshape(-1)
        half = flat.numel() // 2
        for start, end in [(0, 5000), (half - 4093, half + 130_001), (half, flat.numel())]:
            out = torch.empty(end - start)
            fill_shard_(
                fused,
                0.02,
                False,
                seed=1,
                index=2,
                name=fused.part_names,
                out=out,
                flat=(start, end),
            )
            assert torch.equal(out, flat[start:end]), (start, end)


def test_fused_names_must_match_the_parts():
    with pytest.raises(ValueError, match="3 parts"):
        fill_shard_(
            _fused(8, 8, ("gate", "up")), 0.02, False, seed=0, index=1, name=("a", "b", "c")
        )


def test_state_dict_schema_is_the_same_at_every_tp():
    """Names and logical shapes do not depend on tp (kv heads split at 2, replicated at 4), so a checkpoint's
    tensors reshard by concatenating shards on `partition_dim`; the fused weights are [2, out, in]."""
    cfg = ModelConfig(**CFG)
    schemas = []
    for tp_size in (1, 2, 4):
        model = CausalLM(
            cfg, seed=0, parallel=LayerParallel.without_groups(tp=tp_size, tp_rank=tp_size - 1)
        )
        schemas.append(
            {name: p.full_shape for name, p in model.named_parameters() if hasattr(p, "full_shape")}
        )
    assert schemas[0] == schemas[1] == schemas[2]
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    assert schemas[0]["layers.1.attention.wkv.weight"] == (2, kv_dim, cfg.dim)
    assert schemas[0]["layers.1.feed_forward.w13.weight"] == (2, cfg.ffn_dim, cfg.dim)


def test_fused_weights_keep_the_values_of_the_projections_they_fuse():
    """A seed gives the model it gave before k/v and gate/up were fused: each part draws under its old name
    (an expert's under its global id), whichever tp rank holds it."""
    cfg = ModelConfig(**{**CFG, "moe_experts": 4, "moe_every": 2})
    model = CausalLM(
        cfg, seed=6, parallel=LayerParallel.without_groups(tp=2, ep=2, tp_rank=1, ep_rank=1)
    )
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    cases = [
        (
            model.layers[1].attention.wkv.weight,
            1,
            ("attention.wk.weight", "attention.wv.weight"),
            kv_dim,
        ),
        (
            model.layers[1].feed_forward.w13.weight,
            1,
            ("feed_forward.w1.weight", "feed_forward.w3.weight"),
            cfg.ffn_dim,
        ),
        (
            model.layers[2].feed_forward.local_experts[0].w13.weight,
            2,
            ("feed_forward.experts.2.w1.weight", "feed_forward.experts.2.w3.weight"),
            cfg.ffn_dim,
        ),
    ]
    for fused, index, names, rows in cases:
        for part, name in enumerate(names):
            single = _mib_matrix(rows, cfg.dim, 0)
            with torch.no_grad():
                fill_shard_(single, cfg.init_std, False, seed=6, index=index, name=name)
            assert torch.equal(fused[part], single), name
