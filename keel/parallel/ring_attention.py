"""Ring attention: causal (or document-masked) attention over a sequence that cp ranks hold in pieces.

Each rank holds its queries, keys and values for two chunks of the sequence (keel/parallel/context.py). The keys
and values go round the cp ring: at step i a rank attends its queries to the K/V of rank r-i while it already
sends those to rank r+1 and receives rank r-i-1's (`comm.ring_shift`, asynchronous point-to-point), so the
transfer hides behind the block's attention. Each block's partial output is merged into the running one by its
log-sum-exp, exactly as flash attention merges tiles. Backward runs the same ring: K/V travel again, and each
block's dK/dV travel with them (accumulated in fp32) until, after cp steps, they reach their owner.

Per step a rank does the same work: at step 0 its own causal diagonal; from a rank before it, both its query
chunks against that rank's early chunk; from a rank after it, its late query chunk against both of that rank's
chunks. Under document masking a pair of chunks with no document in common is skipped, and one inside a single
document needs no mask.

Why Keel's own ring, not torch's `context_parallel`: that one patches `F.scaled_dot_product_attention` for
DTensor inputs, supports only the CUDA flash/efficient/cuDNN kernels, and takes no attention mask (document
masking only through flex attention), so it runs neither on gloo/CPU nor with packed documents. Blocks here run
on SDPA's CPU flash kernel, which returns the log-sum-exp and whose backward takes it (keel/adapters/
torch_internals.py); on other devices, on `math_attention`, the plain-PyTorch path every block is tested against.
"""

from __future__ import annotations

import math

import torch

from keel.adapters import torch_internals
from keel.parallel import comm
from keel.parallel.context import CPContext, RingDocuments

# a pair of chunks to attend: (query half, key half, causal, mask | None)
Pair = tuple[int, int, bool, torch.Tensor | None]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: CPContext,
    documents: RingDocuments | None = None,
    logit_probe: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys: q [b, heads, s/cp, d], k and v
    [b, kv_heads, s/cp, d] (RoPE applied, at full-sequence positions), heads a multiple of kv_heads (GQA)."""
    return _RingAttention.apply(q, k, v, cp, documents, logit_probe)


def _pairs(cp: CPContext, source: int, documents: RingDocuments | None) -> list[Pair]:
    """The chunk pairs this rank attends against `source`'s K/V, diagonal blocks first (so every query row has
    a finite log-sum-exp before any block where it sees no key)."""
    pairs = []
    for qi, qc in enumerate(cp.chunks_of(cp.rank)):
        for ki, kc in enumerate(cp.chunks_of(source)):
            if kc > qc or (documents is not None and not documents.live[qc][kc]):
                continue
            mask = None if documents is None or documents.whole[qc][kc] else documents.mask(qc, kc)
            pairs.append((qi, ki, kc == qc, mask))
    return sorted(pairs, key=lambda pair: not pair[2])


def _half(t: torch.Tensor, index: int) -> torch.Tensor:
    c = t.shape[2] // 2
    return t[:, :, index * c : (index + 1) * c]


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """KV heads repeated for their query heads (query head h reads kv head h // (heads / kv_heads), as SDPA's
    GQA does)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_expand`: each kv head sums over its query heads."""
    b, heads, s, d = grad.shape
    return grad if heads == kv_heads else grad.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [b, c, c] (True = attend) → an additive [b, 1, c, c] mask in `dtype`, as the kernels take it."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)[
        :, None
    ]


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block in plain PyTorch (fp32 scores): (output, log-sum-exp [b, heads, s_q], -inf where a row sees no
    key). `mask`: bool [b, s_q, s_k]."""
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    allowed = _allowed(q, k, causal, mask)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])  # exp(-inf) = 0 on dead rows
    return (probs @ v.float()).to(q.dtype), lse


def math_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the merged output and log-sum-exp (flash attention's backward)."""
    scale = 1 / math.sqrt(q.shape[-1])
    qf, kf, vf, go = q.float(), k.float(), v.float(), grad_out.float()
    scores = (qf @ kf.transpose(-1, -2)) * scale
    allowed = _allowed(q, k, causal, mask)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    probs = torch.exp(scores - lse[..., None])
    d_probs = go @ vf.transpose(-1, -2)
    delta = (go * out.float()).sum(-1, keepdim=True)
    d_scores = probs * (d_probs - delta) * scale
    return (
        (d_scores @ kf).to(q.dtype),
        (d_scores.transpose(-1, -2) @ qf).to(k.dtype),
        (probs.transpose(-1, -2) @ go).to(v.dtype),
    )


def _allowed(q, k, causal: bool, mask: torch.Tensor | None) -> torch.Tensor | None:
    if mask is not None:
        return mask[:, None]
    if causal:
        return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return None


def _block(q, k, v, causal: bool, mask: torch.Tensor | None):
    if q.device.type != "cpu":
        return math_attention(q, k, v, causal, mask)
    out, lse = torch_internals.cpu_attention_with_lse(
        q, k, v, causal, None if mask is None else _additive(mask, q.dtype)
    )
    if (
        mask is not None
    ):  # the kernel gives a row with no key lse 0: it must weigh nothing in the merge
        lse = lse.masked_fill(~mask.any(-1)[:, None], -math.inf)
    return out, lse


def _block_backward(grad_out, q, k, v, out, lse, causal: bool, mask: torch.Tensor | None):
    if q.device.type != "cpu":
        return math_attention_backward(grad_out, q, k, v, out, lse, causal, mask)
    return torch_internals.cpu_attention_with_lse_backward(
        grad_out, q, k, v, out, lse, causal, None if mask is None else _additive(mask, q.dtype)
    )


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out, block_lse) -> None:
    """Fold one block's (output, log-sum-exp) for query `rows` into the running fp32 `out`, `lse`."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    out[:, :, rows] = (
        out[:, :, rows] * torch.exp(old - new)[..., None]
        + block_out.float() * torch.exp(block_lse - new)[..., None]
    )
    lse[:, :, rows] = new


def _rows(index: int, local_len: int) -> slice:
    c = local_len // 2
    return slice(index * c, (index + 1) * c)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: CPContext, documents: RingDocuments | None, logit_probe):
        b, heads, local_len, d = q.shape
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((b, heads, local_len), -math.inf, dtype=torch.float32, device=q.device)
        kv = (k, v)
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            shift = comm.ring_shift(list(kv), cp.group) if step < cp.size - 1 else None
            for qi, ki, causal, mask in _pairs(cp, source, documents):
                q_half = _half(q, qi)
                k_half, v_half = (_expand(_half(t, ki), heads) for t in kv)
                block_out, block_lse = _block(q_half, k_half, v_half, causal, mask)
                _merge(out, lse, _rows(qi, local_len), block_out, block_lse)
                if logit_probe is not None:
                    _probe(logit_probe, q_half, k_half, causal, mask)
            if shift is not None:
                kv = tuple(shift.wait())
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.documents = cp, documents
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp, documents = ctx.cp, ctx.documents
        heads, local_len, kv_heads = q.shape[1], q.shape[2], k.shape[1]
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, carried = (k, v), None
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            shift = comm.ring_shift(list(kv), cp.group) if step < cp.size - 1 else None
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for qi, ki, causal, mask in _pairs(cp, source, documents):
                rows = _rows(qi, local_len)
                k_half, v_half = (_expand(_half(t, ki), heads) for t in kv)
                dq_b, dk_b, dv_b = _block_backward(
                    grad_out[:, :, rows],
                    q[:, :, rows],
                    k_half,
                    v_half,
                    out[:, :, rows],
                    lse[:, :, rows],
                    causal,
                    mask,
                )
                dq[:, :, rows] += dq_b
                dk[:, :, _rows(ki, local_len)] += _fold(dk_b.float(), kv_heads)
                dv[:, :, _rows(ki, local_len)] += _fold(dv_b.float(), kv_heads)
            if (
                carried is not None
            ):  # the other ranks' share for the K/V in hand, one step behind it
                before_dk, before_dv = carried.wait()
                dk += before_dk
                dv += before_dv
            carried = comm.ring_shift([dk, dv], cp.group)
            if shift is not None:
                kv = tuple(shift.wait())
        dk, dv = carried.wait()  # after cp steps, this rank's own K/V's gradient is back
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


# elements of one slab of scores the logit probe materializes (64 MiB of fp32), as the model's own probe
PROBE_BLOCK_ELEMENTS = 1 << 24


@torch.no_grad()
def _probe(out: torch.Tensor, q, k, causal: bool, mask: torch.Tensor | None) -> None:
    """`out` ← max(out, the largest q·kᵀ/√d over the pairs this block attends): the monitor's attention-logit
    probe (keel/model/layers.py's record_max_logit, for a block of the ring), a slab of query rows at a time."""
    b, heads, s_q, d = q.shape
    rows = max(1, PROBE_BLOCK_ELEMENTS // max(1, b * heads * k.shape[2]))
    allowed = _allowed(q, k, causal, mask)
    for start in range(0, s_q, rows):
        stop = min(s_q, start + rows)
        scores = (q[:, :, start:stop].float() @ k.float().transpose(-1, -2)) / math.sqrt(d)
        if allowed is not None:
            scores = scores.masked_fill(~allowed[..., start:stop, :], -math.inf)
        out.copy_(torch.maximum(out, scores.amax().to(out.dtype)))
