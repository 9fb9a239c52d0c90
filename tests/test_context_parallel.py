"""Context parallelism (`parallel.cp`): the chunk layout, the ring's blocks against plain attention, and the
whole model under cp — alone and with Ulysses sp, tensor parallel + SP, GQA and packed documents — against one
process, in real gloo worlds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from keel.adapters import torch_internals
from keel.config import ModelConfig
from keel.engine.distributed import init_distributed
from keel.launcher.local import free_port
from keel.model import CausalLM
from keel.model.document_mask import document_layout
from keel.parallel import comm
from keel.parallel.context import CPContext, ring_documents
from keel.parallel.layer_parallel import LayerParallel
from keel.parallel.process_groups import ProcessGroups
from keel.parallel.ring_attention import math_attention, math_attention_backward, ring_attention
from keel.parallel.topology import Topology
from tests.spawned import rank_env, start_world

CFG = dict(vocab_size=200, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_pad_multiple=16)


def test_each_rank_holds_two_opposite_chunks():
    x = torch.arange(16)[None]
    held = [CPContext(rank=r, size=4).local(x)[0].tolist() for r in range(4)]
    assert held == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    for r in range(4):
        assert CPContext(rank=r, size=4).positions(4).tolist() == held[r]
    assert sorted(sum(held, [])) == list(range(16))


def test_ring_documents_tables_follow_the_documents():
    """Chunks of 4 tokens; documents [0-5], [6-13], [14-15] (cp=2: 4 chunks)."""
    ids = torch.tensor([[0] * 6 + [1] * 8 + [2] * 2])
    docs = ring_documents(ids, CPContext(rank=0, size=2))
    # chunk 1 (4-7) shares document 0 with chunk 0, chunk 2 (8-11) only document 1 with chunk 1, not chunk 0
    assert docs.live[1][0] and docs.live[2][1] and not docs.live[2][0] and docs.live[3][2]
    assert not any(
        docs.live[q][k] for q in range(4) for k in range(q + 1, 4)
    )  # never a later chunk
    assert docs.whole[2][2] and not docs.whole[1][0] and not docs.whole[3][3]
    full = document_layout(torch.tensor([[5] * 5 + [9] + [5] * 7 + [9] + [5] * 2]), 9)
    assert torch.equal(
        docs.mask(1, 0)[0], full.mask[0, 0, 4:8, 0:4]
    )  # ids from the same EOS positions
    assert torch.equal(docs.mask(3, 3)[0], full.mask[0, 0, 12:16, 12:16])


def _blocks(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g, dtype=dtype) for _ in range(3))
    mask = torch.rand(2, 8, 8, generator=g) > 0.4
    mask[:, 5] = False  # a query that sees no key of this block
    return q, k, v, mask


@pytest.mark.parametrize("kind", ["causal", "full", "mask"])
def test_block_kernels_match_plain_attention(kind):
    """SDPA's CPU flash kernel (through the adapter) and the plain-PyTorch block agree on output, log-sum-exp and,
    given the merged output and log-sum-exp, gradients; a row with no key weighs nothing."""
    q, k, v, mask = _blocks()
    causal, mask = kind == "causal", mask if kind == "mask" else None
    out, lse = math_attention(q, k, v, causal, mask)
    additive = None
    if mask is not None:
        additive = torch.zeros(mask.shape).masked_fill(~mask, -math.inf)[:, None]
    kout, klse = torch_internals.cpu_attention_with_lse(q, k, v, causal, additive)
    torch.testing.assert_close(kout, out)
    if mask is not None:
        assert torch.isinf(lse[:, :, 5]).all() and (out[:, :, 5] == 0).all()
        klse = klse.masked_fill(~mask.any(-1)[:, None], -math.inf)
    torch.testing.assert_close(klse, lse)
    if mask is None:  # SDPA itself
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(out, ref)
    # gradients against autograd through SDPA with the same mask (a dead row has zero gradient)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    allowed = mask[:, None] if mask is not None else None
    if causal:
        allowed = torch.ones(8, 8, dtype=torch.bool).tril()
    scores = (qq @ kk.transpose(-1, -2)) / 2.0
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    probs = torch.softmax(scores, -1).nan_to_num()
    ref = probs @ vv
    grad = torch.randn_like(ref)
    ref.backward(grad)
    got = math_attention_backward(grad, q, k, v, out, lse.nan_to_num(neginf=0.0), causal, mask)
    kgot = torch_internals.cpu_attention_with_lse_backward(
        grad, q, k, v, out, lse.nan_to_num(neginf=0.0), causal, additive
    )
    for mine, kernel, want in zip(got, kgot, (qq.grad, kk.grad, vv.grad)):
        torch.testing.assert_close(mine, want)
        torch.testing.assert_close(kernel, want)


def check_ring_of_one(device: str, documents: bool) -> None:
    """`ring_attention` on one rank (its two chunks are the whole sequence; the ring's steps, merges and backward
    all run, the transfers are local) against SDPA with the same mask, forward and gradients, on `device`: the
    CPU flash kernel there, the plain-PyTorch blocks on CUDA (tests/test_gpu.py)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 16, 8, generator=g)
    k, v = (torch.randn(2, 2, 16, 8, generator=g) for _ in range(2))
    ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 2, [0] * 16])
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    cp = CPContext(comm.single("cp"))  # one rank: every shift is the identity
    ring = ring_documents(ids.to(device), cp) if documents else None
    out = ring_attention(q, k, v, cp, ring)
    grad = torch.randn(out.shape, generator=g).to(device)
    out.backward(grad)
    got = [out.detach(), q.grad, k.grad, v.grad]
    for t in (q, k, v):
        t.grad = None
    mask = None
    if documents:
        ids = ids.to(device)
        mask = (ids[:, :, None] == ids[:, None, :]) & torch.ones(
            16, 16, dtype=torch.bool, device=device
        ).tril()
    want = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None if mask is None else mask[:, None],
        is_causal=mask is None,
        enable_gqa=True,
    )
    want.backward(grad)
    for a, b in zip(got, [want.detach(), q.grad, k.grad, v.grad]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("documents", [False, True])
def test_a_ring_of_one_equals_sdpa(documents):
    check_ring_of_one("cpu", documents)


def _full_grad(param: torch.nn.Parameter, parallel: LayerParallel) -> torch.Tensor:
    """The gradient of the whole model: summed over the ranks splitting the sequence, gathered over tp."""
    grad = (
        comm.all_reduce(param.grad.clone(), parallel.seq.group)
        if parallel.seq.size > 1
        else param.grad
    )
    dim = getattr(param, "partition_dim", None)
    if dim is None or not getattr(param, "tensor_model_parallel", False):
        return grad
    return torch.cat(comm.all_gather(grad, parallel.tp.group), dim=dim)


def _check(layout: dict, kv_heads: int, eos: int | None, groups: ProcessGroups) -> None:
    """One layout's loss, gradients and logit probe against the one-process model's."""
    layout = dict(layout)
    sequence_parallel = layout.pop("sequence_parallel", False)
    cfg = ModelConfig(**{**CFG, "n_kv_heads": kv_heads})
    topology = Topology.from_env(**layout, groups=groups)
    parallel = LayerParallel.from_topology(topology, sequence_parallel, seed=7)
    model = CausalLM(cfg, seed=3, parallel=parallel, z_loss=1e-3, document_eos=eos)
    reference = CausalLM(cfg, seed=3, z_loss=1e-3, document_eos=eos)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=g)
    if eos is not None:  # documents end inside chunks and on a chunk boundary, differently per row
        tokens[0, [3, 12, 20]] = eos
        tokens[1, [8, 29]] = eos
    probe = torch.full((), float("-inf"))
    ref_probe = torch.full((), float("-inf"))
    model.layers[1].attention.logit_probe = probe
    reference.layers[1].attention.logit_probe = ref_probe
    loss = model(tokens[:, :-1], tokens[:, 1:])
    ref_loss = reference(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    # the probe sees this rank's queries: its max over the sequence ranks is the whole sequence's
    comm.all_reduce(probe, topology.device("world"), op="max")
    torch.testing.assert_close(probe, ref_probe)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        want, got = ref_params[name].grad, _full_grad(param, parallel)
        rows = min(want.shape[0], got.shape[0])
        torch.testing.assert_close(
            got[:rows], want[:rows], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def _worker(rank: int, world: int, port: int, cases: list) -> None:
    rank_env(rank, world, port)
    init_distributed()  # DeepSpeed's too: Ulysses runs through its DistributedAttention
    groups = ProcessGroups()  # a rank set two layouts share is created once
    try:
        for layout, kv_heads, eos in cases:
            try:
                _check(layout, kv_heads, eos, groups)
            except AssertionError as error:
                raise AssertionError(f"{layout} kv_heads={kv_heads} eos={eos}: {error}") from None
    finally:
        dist.destroy_process_group()


# (layout, kv heads, the EOS id of packed documents) per world size; one world runs all of its size
CASES = {
    2: [
        (dict(cp=2), 4, None),  # no GQA
        (dict(cp=2), 2, 5),  # packed documents: a document split between ranks, pairs skipped
    ],
    4: [
        (dict(cp=4), 2, None),
        (dict(cp=4), 1, 5),
        (dict(cp=2, sp=2), 2, None),  # 2-D: Ulysses inside, the ring across
        (dict(cp=2, tp=2, sequence_parallel=True), 2, None),
        (dict(cp=2, tp=2, sequence_parallel=True), 2, 5),
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(CASES))
def test_context_parallel_model_equals_one_process(world):
    """Loss, every parameter's gradient and the attention-logit probe after one forward/backward equal the
    one-process model's (fp32, 1e-5), for every layout of `CASES`."""
    start_world(_worker, (world, free_port(), CASES[world]), world)
