"""Context parallelism's layout: which tokens of a sequence each cp rank holds, and which of them attend which.

The sequence is cut into 2·cp equal chunks and cp rank r holds chunks r and 2·cp-1-r, in that order (the
load-balanced layout of Megatron-Core's CP and of ring-flash-attention's zigzag): under a causal mask an early
chunk attends little and a late one much, so every rank gets one of each and no rank idles on the masked half
while the ring turns (keel/parallel/ring_attention.py). Outside attention every layer is position-wise, so a rank
simply runs its tokens; RoPE takes their positions in the full sequence (`positions`), and document masking
takes each token's document (`RingDocuments`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keel.parallel import comm


@dataclass(frozen=True)
class CPContext:
    group: comm.Group | None = None  # the cp group's device channel
    rank: int = 0
    size: int = 1

    @classmethod
    def from_topology(cls, topology) -> CPContext:
        if topology is None or topology.size("cp") == 1:
            return cls()
        return cls(topology.device("cp"), topology.rank_in("cp"), topology.size("cp"))

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two chunk indices (of 2·cp) cp rank `rank` holds."""
        return rank, 2 * self.size - 1 - rank

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of `x` along `dim` (the full sequence), concatenated."""
        if self.size == 1:
            return x
        parts = x.chunk(2 * self.size, dim=dim)
        first, second = self.chunks_of(self.rank)
        return torch.cat([parts[first], parts[second]], dim=dim)

    def positions(self, local_len: int, device: torch.device | None = None) -> torch.Tensor:
        """The positions in the full sequence of this rank's `local_len` tokens."""
        chunk = local_len // 2
        return torch.cat(
            [
                torch.arange(c * chunk, (c + 1) * chunk, device=device)
                for c in self.chunks_of(self.rank)
            ]
        )


@dataclass(frozen=True)
class RingDocuments:
    """Packed documents under cp: each token's document in the full sequence, and per pair of chunks whether any
    query of one attends any key of the other (`live`: else the pair is skipped) and whether every causally
    allowed pair lies in one document (`whole`: then no mask is needed). The tables are read on the host, once per
    micro-batch (one transfer), so the ring decides its work without a sync per block."""

    ids: torch.Tensor  # [b, s] the document index of every token of the full sequence
    chunk: int  # tokens per chunk: s / (2·cp)
    live: tuple[tuple[bool, ...], ...]  # [query chunk][key chunk]
    whole: tuple[tuple[bool, ...], ...]

    def mask(self, q_chunk: int, k_chunk: int) -> torch.Tensor:
        """[b, c, c] bool: query i of `q_chunk` may attend key j of `k_chunk` (same document, causal)."""
        c = self.chunk
        q_ids = self.ids[:, q_chunk * c : (q_chunk + 1) * c]
        k_ids = self.ids[:, k_chunk * c : (k_chunk + 1) * c]
        allowed = q_ids[:, :, None] == k_ids[:, None, :]
        if q_chunk == k_chunk:
            allowed &= torch.ones(c, c, dtype=torch.bool, device=allowed.device).tril()
        return allowed


def ring_documents(ids: torch.Tensor, cp: CPContext) -> RingDocuments:
    """The tables of `RingDocuments` for document indices `ids` [b, s], non-decreasing along each row (a document
    is a run of tokens), so two chunks share a document exactly when their boundary tokens do."""
    n = 2 * cp.size
    chunk = ids.shape[1] // n
    first, last = ids[:, ::chunk], ids[:, chunk - 1 :: chunk]  # [b, n] each
    # k < q: key chunk k's last document reaches query chunk q's first (live); k's first is q's last (whole)
    live = (last[:, None, :] == first[:, :, None]).any(0)  # [q, k]
    whole = (first[:, None, :] == last[:, :, None]).all(0)
    live_rows, whole_rows = torch.stack([live, whole]).cpu().tolist()
    return RingDocuments(
        ids,
        chunk,
        tuple(tuple(k < q and live_rows[q][k] or k == q for k in range(n)) for q in range(n)),
        tuple(tuple(k <= q and whole_rows[q][k] for k in range(n)) for q in range(n)),
    )
