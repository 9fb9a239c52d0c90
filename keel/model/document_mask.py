"""Document masking for packed windows: attention stays inside each document, RoPE positions restart at each.

Computed in the model's forward from the input tokens (a document starts at the window's first token and after
every EOS), so nothing extra travels with a batch and the trainer's tokens[:, :-1] / tokens[:, 1:] split is
unchanged. The mask is SDPA's boolean `attn_mask` (True = attend), block-diagonal and causal. Under context
parallelism no [s, s] mask is built: each rank keeps its tokens' positions and the ring masks chunk pairs from
the tokens' document indices (keel/parallel/context.py `RingDocuments`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keel.parallel.context import CPContext, RingDocuments, ring_documents


@dataclass(frozen=True)
class DocumentLayout:
    mask: (
        torch.Tensor | None
    )  # [b, 1, s, s] bool: query i may attend key j (same document, j <= i); None under cp
    positions: torch.Tensor  # [b, s] long: position within its document (this cp rank's tokens)
    ring: RingDocuments | None = None  # under cp: what the ring attention masks by


def document_layout(
    tokens: torch.Tensor, eos_id: int, cp: CPContext | None = None
) -> DocumentLayout:
    """The block-diagonal causal mask and per-document positions of `tokens` [b, s] (the whole sequence, which
    every rank holds); under context parallelism `cp`, this rank's positions and the ring's tables instead."""
    b, s = tokens.shape
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eos_id
    idx = torch.arange(s, device=tokens.device).expand(b, s)
    # each token's document start
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    doc = starts.cumsum(dim=1)
    if cp is not None and cp.size > 1:
        return DocumentLayout(None, cp.local(idx - first), ring_documents(doc, cp))
    causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal
    return DocumentLayout(mask[:, None], idx - first)
