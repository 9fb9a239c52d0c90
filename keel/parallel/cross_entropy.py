"""Cross-entropy over a vocabulary split across the tensor-parallel group, without gathering the logits.

Each TP rank holds the head's logits for a contiguous slice of the (padded) vocabulary. The loss needs only
per-token statistics of the full row: its max, its sum of exponentials, the target's logit and (for label
smoothing) the sum of the logits. Each is a [b, s] all-reduce, so communication is independent of the vocabulary
size, and the backward needs no communication at all (Megatron's `_VocabParallelCrossEntropy`).

The vocabulary may be padded (to a multiple of the TP size, or for matmul-friendly shapes): entries whose global
index is >= `vocab_size` are not classes. They get no probability mass, no smoothing mass and a zero gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from keel.parallel import comm


def vocab_range(padded_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """`[start, end)` of the vocabulary held by TP rank `rank`: equal contiguous slices, rank 0 first."""
    if padded_vocab_size % world_size:
        raise ValueError(
            f"padded vocabulary {padded_vocab_size} is not divisible by the tensor-parallel size {world_size}; "
            "pad the vocabulary to a multiple of it"
        )
    per_rank = padded_vocab_size // world_size
    return rank * per_rank, (rank + 1) * per_rank


def cross_entropy_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The single-process definition the parallel loss must reproduce, on full (possibly padded) logits.

    Per token: `F.cross_entropy(label_smoothing=ε)` over the true vocabulary, plus PaLM's `z_loss · logZ²`;
    mean over tokens not labelled `ignore_index`. With ε = z = 0 and no padding this is `causal_lm_loss`.
    """
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(compute_dtype)[..., :vocab_size].flatten(0, -2)
    labels = labels.flatten()
    loss = F.cross_entropy(
        logits, labels, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = labels != ignore_index
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1).square()
    return torch.where(valid, loss, 0.0).sum() / valid.sum()


def _all_reduce(tensor: torch.Tensor, op: str, group: comm.Group | None) -> None:
    if group is not None:
        comm.all_reduce(tensor, group, op)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward by [b, s]-sized all-reduces; backward from the saved softmax shard, with no communication."""

    @staticmethod
    def forward(
        ctx,
        logits_shard,
        labels,
        group,
        vocab_start,
        vocab_size,
        label_smoothing,
        z_loss,
        ignore_index,
        reentrant,
        consume,
    ):
        local_size = logits_shard.shape[-1]
        # Real (non-padding) entries are a prefix of every shard: global index < vocab_size.
        n_real = min(max(vocab_size - vocab_start, 0), local_size)
        # A private fp32 copy: it becomes the softmax in place, and the caller's logits stay untouched. Logits the
        # caller hands over (`consume`) and that are fp32 already become the softmax themselves: one [b, s, V]
        # tensor less to allocate and fill (a detached view: it shares the version counter, so anything that
        # saved them for backward would fail loudly).
        compute_dtype = torch.promote_types(logits_shard.dtype, torch.float32)
        in_place = consume and logits_shard.dtype == compute_dtype and not logits_shard.is_leaf
        x = logits_shard.detach() if in_place else logits_shard.to(compute_dtype, copy=True)
        x[..., n_real:] = float("-inf")

        # -inf on a shard that is all padding; the MAX over the group is finite
        row_max = x.amax(dim=-1)
        _all_reduce(row_max, "max", group)
        x.sub_(row_max.unsqueeze(-1))  # shifted logits: exp cannot overflow

        valid = labels != ignore_index
        local_target = labels - vocab_start
        on_shard = valid & (local_target >= 0) & (local_target < local_size)
        local_target = torch.where(on_shard, local_target, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(on_shard, target_logit, 0.0)  # only the owning rank contributes
        _all_reduce(target_logit, "sum", group)

        if label_smoothing:
            logit_sum = x[..., :n_real].sum(dim=-1)
            _all_reduce(logit_sum, "sum", group)

        x.exp_()  # padding: exp(-inf) = 0
        sum_exp = x.sum(dim=-1)
        _all_reduce(sum_exp, "sum", group)
        x.div_(sum_exp.unsqueeze(-1))  # now the softmax over the true vocabulary

        log_sum_exp = sum_exp.log()  # logsumexp of the shifted logits
        log_z = log_sum_exp + row_max
        loss = log_sum_exp - target_logit  # -log p(target)
        if label_smoothing:
            # F.cross_entropy's smoothing: ε · mean over the V true classes of -log p_c = ε · (logZ - mean logit).
            smooth = log_sum_exp - logit_sum / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        if z_loss:
            loss = loss + z_loss * log_z.square()

        n_tokens = valid.sum()
        ctx.save_for_backward(x, log_z, local_target, on_shard, valid, n_tokens)
        ctx.setup = (n_real, vocab_size, label_smoothing, z_loss, logits_shard.dtype, reentrant)
        return torch.where(valid, loss, 0.0).sum() / n_tokens

    @staticmethod
    def backward(ctx, grad_output):
        softmax, log_z, local_target, on_shard, valid, n_tokens = ctx.saved_tensors
        n_real, vocab_size, label_smoothing, z_loss, input_dtype, reentrant = ctx.setup
        # d/dx_c per token: (1 + 2·z·logZ)·p_c - (1-ε)·[c = target] - ε/V on real entries; p_c = 0 on padding.
        # Built in place in the saved softmax, as Megatron does: no second [b, s, V] fp32 tensor (4 GiB at 8k
        # tokens × 128k vocabulary). A second backward through the same graph then fails loudly (autograd's
        # version check) unless the loss was made `reentrant`.
        grad = softmax.clone() if reentrant else softmax
        if z_loss:
            grad.mul_((1.0 + 2.0 * z_loss * log_z).unsqueeze(-1))
        if label_smoothing:
            grad[..., :n_real] -= label_smoothing / vocab_size
        target_grad = torch.where(on_shard, 1.0 - label_smoothing, 0.0).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -target_grad.unsqueeze(-1))
        grad.mul_((valid * (grad_output / n_tokens)).unsqueeze(-1))  # ignored tokens: zero gradient
        return grad.to(input_dtype), None, None, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    group,
    vocab_start: int,
    vocab_size: int,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    ignore_index: int = -100,
    *,
    reentrant: bool = False,
    consume: bool = False,
) -> torch.Tensor:
    """Mean loss (fp32 scalar) over tokens not labelled `ignore_index`, equal to `cross_entropy_reference`.

    `logits_shard` [b, s, V_local] holds global vocabulary entries `[vocab_start, vocab_start + V_local)` of this
    rank's slice (see `vocab_range`); `labels` [b, s] are global ids, identical on every rank of `group`;
    `vocab_size` is the true vocabulary size, entries at or beyond it being padding. With `group` None (tp = 1 or
    not distributed) the shard must be the whole vocabulary and nothing is communicated. Every rank of `group`
    must call this (it is collective). As with `F.cross_entropy`, a batch whose tokens are all ignored gives NaN.
    The gradient comes back in the input's dtype. Backward reuses the saved softmax's memory, so it runs once per
    forward; `reentrant=True` keeps it intact for a retained graph (double backward, gradcheck) at one more
    [b, s, V_local] tensor. `consume=True` says the caller has no further use for `logits_shard` (the training
    loss, right after the head): fp32 logits, not a leaf, are then overwritten instead of copied.
    """
    if vocab_size <= 0 or vocab_start < 0:
        raise ValueError(
            f"need vocab_size > 0 and vocab_start >= 0, got {vocab_size} and {vocab_start}"
        )
    if group is None and (vocab_start != 0 or logits_shard.shape[-1] < vocab_size):
        raise ValueError(
            f"without a process group the logits must cover the whole vocabulary of {vocab_size} from index 0; "
            f"got entries [{vocab_start}, {vocab_start + logits_shard.shape[-1]})"
        )
    return _VocabParallelCrossEntropy.apply(
        logits_shard,
        labels,
        group,
        vocab_start,
        vocab_size,
        label_smoothing,
        z_loss,
        ignore_index,
        reentrant,
        consume,
    )
