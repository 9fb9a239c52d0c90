"""Vocab-parallel cross-entropy: equal to the single-process reference in value and gradient, in one process and
across real gloo processes, and never communicating more than one number per token."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from keel.model import causal_lm_loss
from keel.parallel.cross_entropy import cross_entropy_reference, vocab_parallel_cross_entropy, vocab_range
from keel.parallel.topology import Topology

B, S = 2, 8
PAD_LOGIT = 50.0  # padded entries hold this: if any leaked into max, sum-exp or smoothing the loss would move


def make_inputs(vocab_size: int, padded: int, dtype=torch.float32, seed: int = 0):
    """Logits [B, S, padded] with large values in the padding, labels spread over the vocabulary, a few ignored."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(B, S, padded, generator=g)
    logits[..., vocab_size:] = PAD_LOGIT
    labels = torch.randint(0, vocab_size, (B, S), generator=g)
    labels[0, 0] = 0
    labels[0, 1] = vocab_size - 1  # the first and last real entries, so every shard boundary is exercised
    labels[1, 2] = labels[1, 5] = -100
    return logits.to(dtype), labels


def loss_and_grad(fn, logits: torch.Tensor, grad_scale: float = 2.5):
    leaf = logits.detach().clone().requires_grad_()
    loss = fn(leaf)
    (grad_scale * loss).backward()
    return loss.detach(), leaf.grad


CASES = [(eps, z) for eps in (0.0, 0.1) for z in (0.0, 1e-4, 0.1)]


@pytest.mark.parametrize("eps,z", CASES)
def test_matches_reference_with_padding_and_ignored_tokens(eps, z):
    logits, labels = make_inputs(vocab_size=50, padded=64)
    ref_loss, ref_grad = loss_and_grad(lambda x: cross_entropy_reference(x, labels, 50, eps, z), logits)
    loss, grad = loss_and_grad(lambda x: vocab_parallel_cross_entropy(x, labels, None, 0, 50, eps, z), logits)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-5)
    assert grad[..., 50:].abs().max() == 0  # padding gets no gradient
    assert grad[1, 2].abs().max() == 0 and grad[1, 5].abs().max() == 0  # nor do ignored tokens


def test_z_loss_is_visible():
    logits, labels = make_inputs(vocab_size=50, padded=64)
    plain = vocab_parallel_cross_entropy(logits, labels, None, 0, 50)
    with_z = vocab_parallel_cross_entropy(logits, labels, None, 0, 50, z_loss=0.1)
    assert with_z - plain > 0.1


def test_reference_is_pytorch_cross_entropy():
    logits, labels = make_inputs(vocab_size=50, padded=64)
    real = logits[..., :50].flatten(0, 1)
    for eps in (0.0, 0.1):
        expected = F.cross_entropy(real, labels.flatten(), ignore_index=-100, label_smoothing=eps)
        torch.testing.assert_close(cross_entropy_reference(logits, labels, 50, eps), expected)


def test_equals_causal_lm_loss_without_padding():
    logits, labels = make_inputs(vocab_size=64, padded=64)
    ref_loss, ref_grad = loss_and_grad(lambda x: causal_lm_loss(x, labels), logits)
    loss, grad = loss_and_grad(lambda x: vocab_parallel_cross_entropy(x, labels, None, 0, 64), logits)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-5)


def test_bf16_input_gives_fp32_loss_and_bf16_grad():
    logits, labels = make_inputs(vocab_size=50, padded=64, dtype=torch.bfloat16)
    ref_loss, ref_grad = loss_and_grad(lambda x: cross_entropy_reference(x, labels, 50, 0.1, 1e-4), logits)
    loss, grad = loss_and_grad(lambda x: vocab_parallel_cross_entropy(x, labels, None, 0, 50, 0.1, 1e-4), logits)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-4, rtol=1e-2)


def test_gradcheck_in_double():
    logits, labels = make_inputs(vocab_size=10, padded=12)
    logits = logits[..., :12].double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_cross_entropy(x, labels, None, 0, 10, 0.1, 0.1), (logits,)
    )


def test_input_logits_are_not_modified():
    logits, labels = make_inputs(vocab_size=50, padded=64)
    before = logits.clone()
    vocab_parallel_cross_entropy(logits, labels, None, 0, 50, 0.1, 1e-4)
    assert torch.equal(logits, before)


def test_without_group_the_shard_must_be_the_whole_vocabulary():
    logits, labels = make_inputs(vocab_size=50, padded=64)
    with pytest.raises(ValueError, match="whole vocabulary"):
        vocab_parallel_cross_entropy(logits[..., :32], labels, None, 0, 50)


def test_vocab_range():
    assert [vocab_range(64, r, 4) for r in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    with pytest.raises(ValueError, match="divisible"):
        vocab_range(61, 0, 4)


# -- real processes ---------------------------------------------------------------------------------------------

VOCAB, PADDED, EPS, Z = 61, 64, 0.1, 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, tp: int, port: int, out_dir: str) -> None:
    """One rank: shard the shared logits over its TP group, take loss and gradient, record every collective."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        topology = Topology.from_env(tp=tp)
        group = dist.group.WORLD if tp == world_size else topology.group("tp")
        # Replicas of different data-parallel ranks see different data, so a wrong group cannot pass.
        logits, labels = make_inputs(VOCAB, PADDED, seed=topology.dp_rank)
        start, end = vocab_range(PADDED, topology.rank_in("tp"), tp)

        communicated = []
        for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor"):
            original = getattr(dist, name)

            def record(*args, _original=original, _name=name, **kwargs):
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
                communicated.extend((_name, t.numel()) for t in tensors)
                return _original(*args, **kwargs)

            setattr(dist, name, record)

        shard = logits[..., start:end].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, labels, group, start, VOCAB, EPS, Z)
        (2.5 * loss).backward()
        torch.save(
            {"loss": loss.detach(), "grad": shard.grad, "start": start, "dp_rank": topology.dp_rank,
             "communicated": communicated},
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[(2, 2), (4, 4), (4, 2)], ids=lambda p: f"world{p[0]}-tp{p[1]}")
def parallel_run(request, tmp_path_factory):
    world_size, tp = request.param
    out = tmp_path_factory.mktemp(f"xent_w{world_size}_tp{tp}")
    mp.spawn(_worker, args=(world_size, tp, _free_port(), str(out)), nprocs=world_size, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(world_size)]


def test_parallel_loss_and_gradient_match_reference(parallel_run):
    by_replica: dict[int, list[dict]] = {}
    for result in parallel_run:
        by_replica.setdefault(result["dp_rank"], []).append(result)
    for dp_rank, results in by_replica.items():
        logits, labels = make_inputs(VOCAB, PADDED, seed=dp_rank)
        ref_loss, ref_grad = loss_and_grad(lambda x: cross_entropy_reference(x, labels, VOCAB, EPS, Z), logits)
        grad = torch.cat([r["grad"] for r in sorted(results, key=lambda r: r["start"])], dim=-1)
        for r in results:
            torch.testing.assert_close(r["loss"], ref_loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)


def test_parallel_never_communicates_full_vocab_tensors(parallel_run):
    for result in parallel_run:
        names = [name for name, _ in result["communicated"]]
        assert names == ["all_reduce"] * 4  # max, target logit, logit sum (smoothing), sum-exp
        assert all(numel <= B * S for _, numel in result["communicated"])
