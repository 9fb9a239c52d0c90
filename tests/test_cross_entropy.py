"""Vocab-parallel cross-entropy: equal to the single-process reference in value and gradient, in one process and
across real gloo processes, and never communicating more than one number per token."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from keel.launcher.local import free_port
from keel.model import causal_lm_loss
from keel.parallel.cross_entropy import (
    cross_entropy_reference,
    vocab_parallel_cross_entropy,
    vocab_range,
)
from keel.parallel.topology import Topology
from tests.spawned import start_world

B, S = 2, 8
PAD_LOGIT = 50.0  # padded entries hold this: if any leaked into max, sum-exp or smoothing the loss would move


def make_inputs(vocab_size: int, padded: int, dtype=torch.float32, seed: int = 0):
    """Logits [B, S, padded] with large values in the padding, labels spread over the vocabulary, a few ignored."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(B, S, padded, generator=g)
    logits[..., vocab_size:] = PAD_LOGIT
    labels = torch.randint(0, vocab_size, (B, S), generator=g)
    labels[0, 0] = 0
    labels[0, 1] = vocab_size - 1  # the first and last true entries are targets too
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
    ref_loss, ref_grad = loss_and_grad(
        lambda x: cross_entropy_reference(x, labels, 50, eps, z), logits
    )
    loss, grad = loss_and_grad(
        lambda x: vocab_parallel_cross_entropy(x, labels, None, 0, 50, eps, z), logits
    )
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
    loss, grad = loss_and_grad(
        lambda x: vocab_parallel_cross_entropy(x, labels, None, 0, 64), logits
    )
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, ref_grad, atol=1e-7, rtol=1e-5)


def test_bf16_input_gives_fp32_loss_and_bf16_grad():
    logits, labels = make_inputs(vocab_size=50, padded=64, dtype=torch.bfloat16)
    ref_loss, ref_grad = loss_and_grad(
        lambda x: cross_entropy_reference(x, labels, 50, 0.1, 1e-4), logits
    )
    loss, grad = loss_and_grad(
        lambda x: vocab_parallel_cross_entropy(x, labels, None, 0, 50, 0.1, 1e-4), logits
    )
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-4, rtol=1e-2)


def test_gradcheck_in_double():
    logits, labels = make_inputs(vocab_size=10, padded=12)
    logits = logits[..., :12].double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_cross_entropy(x, labels, None, 0, 10, 0.1, 0.1, reentrant=True),
        (logits,),
    )


def test_backward_in_place_matches_reentrant_and_a_second_backward_fails_loudly():
    """The default backward builds the gradient in the saved softmax: same values; a retained graph's second
    backward would read a clobbered softmax, so autograd's version check must refuse it."""
    logits, labels = make_inputs(vocab_size=50, padded=64)
    grads = []
    for reentrant in (False, True):
        x = logits.clone().requires_grad_()
        vocab_parallel_cross_entropy(
            x, labels, None, 0, 50, 0.1, 1e-3, reentrant=reentrant
        ).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, labels, None, 0, 50, 0.1, 1e-3)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_input_logits_are_not_modified():
    logits, labels = make_inputs(vocab_size=50, padded=64)
    before = logits.clone()
    vocab_parallel_cross_entropy(logits, labels, None, 0, 50, 0.1, 1e-4)
    assert torch.equal(logits, before)


def test_consumed_logits_become_the_softmax_with_the_same_loss_and_gradients():
    """`consume=True` (the training loss right after the head) overwrites fp32 logits instead of copying them: the
    same loss and gradients; a leaf or a bf16 input is still copied; anything that saved the logits for its own
    backward fails loudly instead of reading the softmax."""
    logits, labels = make_inputs(vocab_size=50, padded=64)
    hidden = torch.randn(logits.shape[0], logits.shape[1], 16)
    head = torch.randn(64, 16)
    results = []
    for consume in (False, True):
        h = hidden.clone().requires_grad_()
        z = h @ head.T
        before = z.detach().clone()
        loss = vocab_parallel_cross_entropy(z, labels, None, 0, 50, 0.1, 1e-3, consume=consume)
        assert torch.equal(z.detach(), before) != consume  # overwritten only when consumed
        loss.backward()
        results.append((loss.detach(), h.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    for kept in (
        logits.clone().requires_grad_(),
        logits.bfloat16(),
    ):  # a leaf; a dtype the loss must upcast
        before = kept.detach().clone()
        vocab_parallel_cross_entropy(kept, labels, None, 0, 50, consume=True)
        assert torch.equal(kept.detach(), before)
    h = hidden.clone().requires_grad_()
    z = h @ head.T
    saved = z.square().mean()  # its backward needs z as it was
    loss = vocab_parallel_cross_entropy(z, labels, None, 0, 50, consume=True) + saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_without_group_the_shard_must_be_the_whole_vocabulary():
    logits, labels = make_inputs(vocab_size=50, padded=64)
    with pytest.raises(ValueError, match="whole vocabulary"):
        vocab_parallel_cross_entropy(logits[..., :32], labels, None, 0, 50)


def test_vocab_range():
    assert [vocab_range(64, r, 4) for r in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    with pytest.raises(ValueError, match="divisible"):
        vocab_range(61, 0, 4)


# -- real processes ---------------------------------------------------------------------------------------------
# Spawning is the slow part (each process imports torch), so every process runs several cases:
#   world:  the whole world is the TP group, true vocab 61 padded to 64;
#   tp2:    Topology(tp=2) groups; with 4 processes each TP pair sees different data, so a wrong group fails;
#   empty:  true vocab 45 padded to 64, so with 4 ranks the last shard is all padding.

PADDED, EPS, Z = 64, 0.1, 1e-4
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter_tensor",
)


def _record_collectives(log: list[tuple[str, int]]) -> None:
    """Wrap this process's collectives so each call logs (name, numel) of every tensor it is given."""
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def record(*args, _original=original, _name=name, **kwargs):
            for arg in (*args, *kwargs.values()):
                for t in arg if isinstance(arg, list) else [arg]:
                    if isinstance(t, torch.Tensor):
                        log.append((_name, t.numel()))
            return _original(*args, **kwargs)

        setattr(dist, name, record)


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank: for each case, shard the logits over the TP group, take loss and gradient, log the collectives."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        topology = Topology.from_env(tp=2)
        cases = {  # name: (group, rank in it, its size, true vocab, data seed)
            "world": (topology.device("world"), rank, world_size, 61, 0),
            "tp2": (topology.device("tp"), topology.rank_in("tp"), 2, 61, topology.dp_rank),
            "empty": (topology.device("world"), rank, world_size, 45, 0),
        }
        log: list[tuple[str, int]] = []
        _record_collectives(log)
        results = {}
        for case, (group, tp_rank, tp, vocab, seed) in cases.items():
            log.clear()
            logits, labels = make_inputs(vocab, PADDED, seed=seed)
            start, end = vocab_range(PADDED, tp_rank, tp)
            shard = logits[..., start:end].clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(shard, labels, group, start, vocab, EPS, Z)
            (2.5 * loss).backward()
            results[case] = {
                "loss": loss.detach(),
                "grad": shard.grad,
                "start": start,
                "vocab": vocab,
                "seed": seed,
                "communicated": list(log),
            }
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def parallel_run(request, tmp_path_factory) -> list[dict]:
    """Per rank, {case: result}; the processes run once per world size for all the tests below."""
    world_size = request.param
    out = tmp_path_factory.mktemp(f"xent_world{world_size}")
    start_world(_worker, (world_size, free_port(), str(out)), world_size)
    return [torch.load(out / f"rank{r}.pt") for r in range(world_size)]


@pytest.mark.parametrize("case", ["world", "tp2", "empty"])
def test_parallel_loss_and_gradient_match_reference(parallel_run, case):
    replicas: dict[int, list[dict]] = {}  # ranks sharing a data seed form one TP group
    for rank_results in parallel_run:
        result = rank_results[case]
        replicas.setdefault(result["seed"], []).append(result)
    for seed, shards in replicas.items():
        vocab = shards[0]["vocab"]
        logits, labels = make_inputs(vocab, PADDED, seed=seed)
        reference = functools.partial(
            cross_entropy_reference, labels=labels, vocab_size=vocab, label_smoothing=EPS, z_loss=Z
        )
        ref_loss, ref_grad = loss_and_grad(reference, logits)
        for shard in shards:
            torch.testing.assert_close(shard["loss"], ref_loss, atol=1e-6, rtol=1e-6)
        grad = torch.cat(
            [shard["grad"] for shard in sorted(shards, key=lambda r: r["start"])], dim=-1
        )
        torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)


def test_parallel_never_communicates_full_vocab_tensors(parallel_run):
    for rank_results in parallel_run:
        for result in rank_results.values():
            # max, target logit, logit sum (for smoothing), sum-exp: one [b, s] all-reduce each
            assert result["communicated"] == [("all_reduce", B * S)] * 4
