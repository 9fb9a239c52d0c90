"""The tensor-parallel model, layer by layer, against the unparallelized one — real processes over gloo."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from keel.config import ModelConfig
from keel.launcher.local import free_port
from keel.model import CausalLM
from keel.parallel import comm
from keel.parallel.layer_parallel import LayerParallel
from keel.parallel.tensor import TPContext
from keel.parallel.topology import Topology
from tests.spawned import start_world

pytestmark = pytest.mark.slow

CFG = dict(vocab_size=200, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_pad_multiple=16)


def _full_grad(param: torch.nn.Parameter, tp: TPContext) -> torch.Tensor:
    """All-gather a sharded gradient along its partition dim (vocabulary padding included)."""
    grad = param.grad
    dim = getattr(param, "partition_dim", None)
    if dim is None or not getattr(param, "tensor_model_parallel", False):
        return grad
    return torch.cat(comm.all_gather(grad, tp.group), dim=dim)


def _worker(
    rank: int,
    world: int,
    port: int,
    kv_heads: int,
    sequence_parallel: bool,
    document_eos: int | None = None,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = ModelConfig(**{**CFG, "n_kv_heads": kv_heads})
        topology = Topology.from_env(tp=world)
        parallel = LayerParallel.from_topology(topology, sequence_parallel, seed=7)
        model = CausalLM(
            cfg,
            seed=3,
            parallel=parallel,
            label_smoothing=0.1,
            z_loss=1e-3,
            document_eos=document_eos,
        )
        reference = CausalLM(
            cfg, seed=3, label_smoothing=0.1, z_loss=1e-3, document_eos=document_eos
        )
        tokens = torch.randint(
            0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(11)
        )
        if document_eos is not None:  # packed windows: documents end at positions 4 and 10
            tokens[:, 4] = tokens[:, 10] = document_eos
        loss = model(tokens[:, :-1], tokens[:, 1:])
        ref_loss = reference(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        ref_params = dict(reference.named_parameters())
        checked = 0
        for name, param in model.named_parameters():
            want, got = ref_params[name].grad, _full_grad(param, parallel.tp)
            rows = cfg.vocab_size if "tok_embeddings" in name or "output" in name else want.shape[0]
            torch.testing.assert_close(
                got[:rows], want[:rows], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
            assert got[rows:].abs().sum() == 0 and want[rows:].abs().sum() == 0, (
                f"{name}: padding got gradient"
            )
            checked += 1
        assert checked == len(ref_params)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world, kv_heads, sequence_parallel, document_eos",
    [
        (2, 2, False, None),  # kv heads split over tp
        (2, 2, True, None),  # + Megatron sequence parallel
        (4, 2, False, None),  # tp > kv heads: kv heads replicated, their gradients summed over tp
        (4, 2, True, None),
        (2, 2, True, 2),  # data.document_mask: the same block-diagonal mask on every tp rank
    ],
)
def test_tensor_parallel_gradients_equal_single_process(
    world, kv_heads, sequence_parallel, document_eos
):
    """Every parameter's gathered gradient after one step equals tp=1's (embedding, projections, norms)."""
    start_world(_worker, (world, free_port(), kv_heads, sequence_parallel, document_eos), world)


def test_vocab_padding_and_init_match_tp1():
    cfg = ModelConfig(**CFG)
    model = CausalLM(cfg, seed=3)
    assert model.layers[0].tok_embeddings.weight.shape[0] == 208  # 200 padded to a multiple of 16
    assert model.layers[0].tok_embeddings.weight[200:].abs().max() == 0
