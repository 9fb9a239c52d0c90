"""Transformer building blocks with Llama semantics, matching Hugging Face's `LlamaForCausalLM` numerically.

No biases. `wq` is column-parallel, `wkv` (k and v) and `w13` (gate and up) are fused column-parallel
projections — one GEMM each, their parts stacked in one [2, out, in] weight — and `wo, w2` are row-parallel
(keel/parallel/tensor.py); with tp = 1 they are plain linears. Attention and MLP are each one tensor-parallel
region, entered and exited once. Head counts are inferred from the projection widths, so a rank holding
`n_heads / tp` heads runs the same math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from keel.config import ModelConfig
from keel.model.document_mask import DocumentLayout
from keel.model.kernels import resolve, rms_norm, rotary, silu_mul
from keel.parallel.float8 import Float8Spec
from keel.parallel.layer_parallel import NO_PARALLEL, LayerParallel
from keel.parallel.ring_attention import ring_attention
from keel.parallel.tensor import (
    ColumnParallelLinear,
    FusedColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    enter,
    exit,
    fused_linear,
    sum_grad_over_tp,
)
from keel.parallel.ulysses import ulysses_attention


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back before the weight (exactly as HF's LlamaRMSNorm)."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        parallel: LayerParallel = NO_PARALLEL,
        kernels: str = "torch",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.tp = parallel.tp
        self.liger = resolve(kernels) == "liger"
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight.sequence_parallel = self.tp.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, _sp_param(self.weight, self.tp), self.eps, self.liger)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _sp_param(param: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Under sequence parallelism a norm sees only its sequence shard: its gradient is partial on each rank."""
    return sum_grad_over_tp(param, tp) if tp.sequence_parallel else param


class LayerNorm(nn.Module):
    """LayerNorm with bias; like RMSNorm, its parameters' gradients are summed over TP under SP. `kernels` is
    accepted for a uniform signature: `F.layer_norm` is already one fused kernel on every device."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        parallel: LayerParallel = NO_PARALLEL,
        kernels: str = "torch",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.tp = parallel.tp
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.weight.sequence_parallel = self.bias.sequence_parallel = self.tp.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = _sp_param(self.weight, self.tp), _sp_param(self.bias, self.tp)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)


# The norm class by model.norm; keyed by exactly keel.config.NORMS (tested), which validate_model checks against.
NORM_CLASSES: dict[str, type[RMSNorm] | type[LayerNorm]] = {
    "rmsnorm": RMSNorm,
    "layernorm": LayerNorm,
}


def make_norm(cfg: ModelConfig, parallel: LayerParallel = NO_PARALLEL) -> nn.Module:
    """The norm named by `cfg.norm`: RMSNorm (Llama) or LayerNorm with bias. `cfg` was validated (`build_layers`
    runs `validate_model`; a pipeline's layer specs use the run's config, validated before launch)."""
    return NORM_CLASSES[cfg.norm](cfg.dim, eps=cfg.norm_eps, parallel=parallel, kernels=cfg.kernels)


class HeadNorm(nn.Module):
    """QK-norm: RMSNorm over each head's `head_dim` features of q or k, one weight shared by all heads (OLMo 2,
    Qwen3). It bounds the attention logits, which otherwise grow with ‖q‖·‖k‖ (Dehghani et al. 2023).

    Under tensor parallelism each rank normalizes its own heads with a replica of the weight, so the replicas'
    gradients are partial and are summed over the TP group (as for a replicated kv projection). Under Ulysses it
    runs on this rank's sequence chunk before the all-to-all, like the projections.
    """

    def __init__(
        self,
        head_dim: int,
        eps: float,
        parallel: LayerParallel = NO_PARALLEL,
        kernels: str = "torch",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.tp = parallel.tp
        self.liger = resolve(kernels) == "liger"
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, sum_grad_over_tp(self.weight, self.tp), self.eps, self.liger)


class RotaryEmbedding:
    """cos/sin tables for RoPE, one per model in a process, shared by every block's attention.

    Not a module: the tables are a function of the position alone, so n_layers copies of the same [s, head_dim]
    pair would be waste (80 blocks at 128k tokens, head_dim 128, bf16: 5 GiB per rank), and as a plain object they
    are outside state dicts, `.to()` and ZeRO-3's hooks. Built lazily for the longest sequence seen, on the
    input's device and in its dtype (computed in fp32 first, as HF does), so a block needs nothing but the hidden
    state and checkpoints never contain it; another dtype or device rebuilds them.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        # a context-parallel rank's (cos, sin) at its tokens' positions, and what they were computed for
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None
        self._gathered_for: tuple | None = None

    def _tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [len(positions), head_dim] at `positions` (fp32 angles, as HF computes them)."""
        exponents = (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device)
            / self.head_dim
        )
        inv_freq = 1.0 / (self.theta**exponents)
        freqs = torch.outer(positions.float(), inv_freq)
        # rotate_half layout: [θ_0..θ_{d/2-1}, θ_0..θ_{d/2-1}]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _build(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> None:
        positions = torch.arange(seq_len, dtype=torch.float32, device=device)
        self.cos, self.sin = self._tables(positions, dtype)

    def __call__(
        self, x: torch.Tensor, seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [seq, head_dim], for `x` shaped [..., seq, head_dim] (or the first `seq_len`
        positions)."""
        seq_len = seq_len or x.shape[-2]
        cos = self.cos
        if cos is None or cos.shape[0] < seq_len or cos.device != x.device or cos.dtype != x.dtype:
            self._build(seq_len, x.device, x.dtype)
        return self.cos[:seq_len], self.sin[:seq_len]

    def at(
        self, x: torch.Tensor, positions: torch.Tensor, seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) at `positions`: [b, seq] per row (document masking) gives [b, seq, head_dim] tables, [seq]
        (a context-parallel rank's tokens) [seq, head_dim]. Positions are below `seq_len` (default: x's)."""
        cos, sin = self(x, seq_len)
        return cos[positions], sin[positions]

    def at_rank(self, x: torch.Tensor, cp) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [seq, head_dim] at the full-sequence positions of context-parallel rank `cp.rank`'s
        `seq` tokens (the same values as the full tables' rows). Computed once and kept, as the tables are, and
        for this rank's rows only: the full-sequence tables would be cp times larger, and a gather per step a
        new pair of tensors every block's backward keeps."""
        local_len = x.shape[-2]
        key = (local_len, cp.rank, cp.size, x.dtype, x.device)
        if self._gathered_for != key:
            self._gathered = self._tables(cp.positions(local_len, x.device), x.dtype)
            self._gathered_for = key
        return self._gathered


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE (SDPA's `enable_gqa`: kv heads are read, not repeated).

    Under tensor parallelism each rank holds n_heads / tp query heads. KV heads are split the same way when tp
    divides n_kv_heads. When tp > n_kv_heads they are replicated instead (they are small under GQA): every rank
    keeps all of `wkv`, projects only the one kv head its query heads read, and the partial gradients of
    that replicated weight are summed over the TP group.

    k and v are one GEMM (`wkv`, logical [2, kv_dim, dim]); q stays its own (`wq`). A single qkv weight would
    need a per-kv-group layout that has no contiguous tp shard once kv heads are replicated, and the state-dict
    schema must not depend on tp (a checkpoint reshards tp=2 → tp=4), so the split is the same at every tp.

    Under Ulysses sequence parallelism (`parallel.sp`) the projections see this rank's sequence chunk and the
    attention itself runs on the whole sequence for heads / sp (keel/parallel/ulysses.py). Under context
    parallelism (`parallel.cp`) the rank's tokens are two chunks of the sequence; attention is a ring over the cp
    group (keel/parallel/ring_attention.py) with RoPE at the tokens' positions in the full sequence. With both
    (2-D sequence parallelism), Ulysses gathers the cp rank's tokens and the ring runs on those.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        parallel: LayerParallel = NO_PARALLEL,
        fp8: Float8Spec | None = None,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        tp, sp = parallel.tp, parallel.sp
        self.head_dim = cfg.head_dim
        self.tp = tp
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.kv_replicated = cfg.n_kv_heads % tp.size != 0
        self.wq = ColumnParallelLinear(cfg.dim, cfg.n_heads * cfg.head_dim, tp, fp8)
        # replicated kv heads: each rank's k/v gradient is a partial sum (the other query heads' parts are on
        # other ranks), and FP8 scales of partial sums are not one process's, so wkv stays in high precision
        self.wkv = FusedColumnParallelLinear(
            cfg.dim,
            kv_dim,
            TPContext() if self.kv_replicated else tp,
            ("wk", "wv"),
            None if self.kv_replicated else fp8,
        )
        self.wo = RowParallelLinear(cfg.n_heads * cfg.head_dim, cfg.dim, tp, fp8)
        # the model's tables, shared by its blocks (`build_layers`); a lone attention makes its own
        self.rotary = rotary or RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        if cfg.qk_norm:
            self.q_norm = HeadNorm(cfg.head_dim, cfg.norm_eps, parallel, cfg.kernels)
            self.k_norm = HeadNorm(cfg.head_dim, cfg.norm_eps, parallel, cfg.kernels)
        self.qk_norm = cfg.qk_norm
        # the monitor's attention-logit probe (keel/training/observe/attention_logits.py): while set, `_attend` records
        # the largest pre-softmax logit of the pairs it attends into this tensor
        self.logit_probe: torch.Tensor | None = None
        self.liger = resolve(cfg.kernels) == "liger"
        heads_per_rank, n_rep = cfg.n_heads // tp.size, cfg.n_heads // cfg.n_kv_heads
        # the one kv head used here when replicated
        self.kv_head = (tp.rank * heads_per_rank) // n_rep
        self.sp_size = sp.size
        self.cp = parallel.cp
        self.ulysses = ulysses_attention(self._attend, sp) if sp.size > 1 else None

    def _kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.kv_replicated:
            return self.wkv(x)
        rows = slice(self.kv_head * self.head_dim, (self.kv_head + 1) * self.head_dim)
        return fused_linear(x, sum_grad_over_tp(self.wkv.weight, self.tp)[:, rows])

    def forward(self, x: torch.Tensor, document: DocumentLayout | None = None) -> torch.Tensor:
        x = enter(x, self.tp)
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)  # [b, s, heads, head_dim]
        k, v = (t.view(b, s, -1, self.head_dim) for t in self._kv(x))  # [b, s, kv_heads, head_dim]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.ulysses is None:
            out = self._attend(q, k, v, document)
        else:
            # too few kv heads to split over sp: send one per query head
            if k.shape[2] % self.sp_size:
                k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
            out = self.ulysses(q, k, v, 0)
        return exit(self.wo(out.reshape(b, s, -1)), self.tp)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document: DocumentLayout | None = None,
    ) -> torch.Tensor:
        """Causal attention over [b, s, heads, head_dim] inputs (full sequence), RoPE included; with a
        `document` layout, block-diagonal causal with per-document positions (the torch RoPE path: [b, s, d]
        tables)."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, head_dim]
        if self.cp.size > 1:
            return self._ring(q, k, v, document)
        # query head h reads kv head h // (heads / kv_heads): SDPA's own GQA, no repeated copies of k and v
        gqa = q.shape[1] != k.shape[1]
        if document is None:
            cos, sin = self.rotary(q)
            q, k = rotary(q, k, cos, sin, self.liger)
            if self.logit_probe is not None:
                record_max_logit(self.logit_probe, q, k, None)
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=gqa
            ).transpose(1, 2)
        cos, sin = self.rotary.at(q, document.positions)
        q, k = rotary(q, k, cos, sin, liger=False)
        if self.logit_probe is not None:
            record_max_logit(self.logit_probe, q, k, document.mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=document.mask, enable_gqa=gqa)
        return out.transpose(1, 2)

    def _ring(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document: DocumentLayout | None,
    ) -> torch.Tensor:
        """Context-parallel attention of this rank's tokens [b, heads, s/cp, head_dim] over the whole sequence."""
        if document is None:
            (cos, sin), liger = self.rotary.at_rank(q, self.cp), self.liger
        else:
            cos, sin = self.rotary.at(q, document.positions, q.shape[2] * self.cp.size)
            liger = False
        q, k = rotary(q, k, cos, sin, liger)
        ring = None if document is None else document.ring
        out = ring_attention(q, k, v, self.cp, ring, self.logit_probe)
        return out.transpose(1, 2)


# elements of one block of attention scores the logit probe materializes (64 MiB of fp32), whatever the sequence
PROBE_BLOCK_ELEMENTS = 1 << 24


@torch.no_grad()
def record_max_logit(
    out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None
) -> None:
    """`out` ← max(out, the largest q·kᵀ/√d over the pairs attention uses): causal, or `mask` [b, 1, s, s].

    q [b, heads, s, d] and k [b, kv_heads, s, d] after RoPE (and QK-norm); query heads read their kv group as
    SDPA's GQA does. Scores are computed in fp32 a block of query rows at a time (at most
    PROBE_BLOCK_ELEMENTS), so the probe never holds an [s, s] matrix per head.
    """
    b, heads, s, d = q.shape
    groups = k.shape[1]
    qg = q.float().view(b, groups, heads // groups, s, d)
    kf = k.float()[:, :, None]  # [b, groups, 1, s, d]
    rows = max(1, PROBE_BLOCK_ELEMENTS // max(1, b * heads * s))
    best = torch.full((), float("-inf"), device=q.device)
    for start in range(0, s, rows):
        stop = min(s, start + rows)
        # [b, groups, rep, rows, s]
        scores = qg[:, :, :, start:stop] @ kf.transpose(-1, -2) / d**0.5
        if mask is None:
            allowed = torch.ones(stop - start, s, dtype=torch.bool, device=q.device).tril(start)
        else:
            allowed = mask[:, :, None, start:stop]  # [b, 1, 1, rows, s]
        best = torch.maximum(best, scores.masked_fill(~allowed, float("-inf")).amax())
    out.copy_(torch.maximum(out, best.to(out.dtype)))


class SwiGLU(nn.Module):
    """Gated MLP `w2(silu(gate) * up)`: `w13` projects gate (its part 0, `w1`) and up (part 1, `w3`) in one
    GEMM, w2 is the down projection.

    `hidden` overrides the width (MoE experts); `inner` is the MLP without entering or exiting the TP region, for
    callers that are already inside one (the experts and shared expert of an MoE layer).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        parallel: LayerParallel = NO_PARALLEL,
        hidden: int | None = None,
        fp8: Float8Spec | None = None,
    ) -> None:
        super().__init__()
        self.tp = parallel.tp
        hidden = hidden or cfg.ffn_dim
        self.w13 = FusedColumnParallelLinear(cfg.dim, hidden, self.tp, ("w1", "w3"), fp8)
        self.w2 = RowParallelLinear(hidden, cfg.dim, self.tp, fp8)
        self.liger = resolve(cfg.kernels) == "liger"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit(self.inner(enter(x, self.tp)), self.tp)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x)
        return self.w2(silu_mul(gate, up, self.liger))
