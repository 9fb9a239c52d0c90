"""Transformer building blocks with Llama semantics, matching Hugging Face's `LlamaForCausalLM` numerically.

Each projection is its own named `nn.Linear` (no fused qkv, no biases) so tensor parallelism can later swap
`wq, wk, wv, w1, w3` for column-parallel and `wo, w2` for row-parallel versions without touching the math.
Head counts are inferred from the projection widths at run time for the same reason: a column-parallel `wq`
holding `n_heads / tp` heads needs no other change here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from keel.config import ConfigError, ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back before the weight (exactly as HF's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The norm named by `cfg.norm`: RMSNorm (Llama) or LayerNorm with bias."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.dim, eps=cfg.norm_eps)
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
    raise ConfigError(f"model.norm: expected rmsnorm or layernorm, got {cfg.norm!r}")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE, cached per attention as non-persistent buffers.

    The cache is built lazily for the longest sequence seen, on the input's device and in its dtype (computed in
    fp32 first, as HF does), so a block needs nothing but the hidden state and checkpoints never contain it.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)
        # dtype the tables were computed for: `.to(dtype)` casts buffers too, and a bf16-rounded table cast back
        # to fp32 must not be mistaken for an fp32 one
        self._built_dtype: torch.dtype | None = None

    def _build(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> None:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        positions = torch.arange(seq_len, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # rotate_half layout: [θ_0..θ_{d/2-1}, θ_0..θ_{d/2-1}]
        self.cos = angles.cos().to(dtype)
        self.sin = angles.sin().to(dtype)
        self._built_dtype = dtype

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [seq, head_dim], for `x` shaped [..., seq, head_dim]."""
        seq_len = x.shape[-2]
        cos = self.cos
        stale = cos is None or cos.shape[0] < seq_len or cos.device != x.device
        if stale or cos.dtype != x.dtype or cos.dtype != self._built_dtype:
            self._build(seq_len, x.device, x.dtype)
        return self.cos[:seq_len], self.sin[:seq_len]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [b, heads, seq, head_dim] by position (non-interleaved, HF's rotate_half convention)."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE; kv heads are repeated to match the query heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, heads, s, head_dim]
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, kv_heads, s, head_dim]
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(q)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:  # query head h reads kv head h // n_rep
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """Gated MLP `w2(silu(w1 x) * w3 x)`: w1 is the gate, w3 the up projection, w2 the down projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
