"""`model.kernels`: Liger-kernel's Triton kernels for the block's elementwise work, or the plain PyTorch path.

The PyTorch path (`torch`) is the reference: always available, always what the CPU suite trains with. `liger`
routes RMSNorm, RoPE and SwiGLU's silu·mul through Liger-kernel (pure Triton, no nvcc), which fuses each into one
kernel forward and one backward on CUDA. `auto` picks liger where CUDA is available and liger_kernel imports,
torch elsewhere. Triton runs on a CPU only under `TRITON_INTERPRET=1` (tests, tiny shapes), so `liger` is accepted
there too. Imports of liger_kernel are lazy: `import keel` never imports Triton.

At tp = 1 outside a pipeline, `liger` also joins the output head and the loss in Liger's fused linear +
cross-entropy, which works through the tokens in chunks and never holds the full logits (label smoothing and
z-loss are Liger's own `label_smoothing` and `lse_square_scale`, the same definitions as Keel's). Not routed: the
pipeline's head (DeepSpeed's pipeline engine calls the last layer and its `loss_fn` separately, so the logits exist
between them) and tp > 1 (Liger has no vocab-parallel cross-entropy): Keel's own vocab-parallel kernel serves both.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F

from keel.config import ConfigError


@functools.cache
def liger_importable() -> bool:
    return (
        importlib.util.find_spec("liger_kernel") is not None
        and importlib.util.find_spec("triton") is not None
    )


def resolve(kernels: str) -> str:
    """`auto` → "liger" on CUDA with liger_kernel importable, else "torch"; `liger` fails here in one line when it
    cannot run (no liger_kernel/triton, or neither CUDA nor TRITON_INTERPRET=1)."""
    runnable = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    if kernels == "auto":
        return "liger" if torch.cuda.is_available() and liger_importable() else "torch"
    if kernels == "liger" and not (liger_importable() and runnable):
        why = (
            "liger_kernel/triton are not installed" if not liger_importable() else "no CUDA device"
        )
        raise ConfigError(
            f"model.kernels=liger: {why}; install liger-kernel on a CUDA machine or set "
            "model.kernels=torch"
        )
    return kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, liger: bool) -> torch.Tensor:
    """RMSNorm in fp32, cast back before the weight (HF's LlamaRMSNorm order; Liger's "llama" casting mode)."""
    if liger:
        # optional dependency (keel[liger]); only on the liger path
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [b, heads, seq, head_dim] by position (non-interleaved, HF's rotate_half convention)."""
    return x * cos + _rotate_half(x) * sin


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, liger: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [b, heads, s, d] and k [b, kv_heads, s, d] with [s, d] tables, or per-row [b, s, d] ones
    (document masking: torch path only) (HF's rotate_half convention)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    elif liger:
        # optional dependency (keel[liger]); only on the liger path
        from liger_kernel.ops.rope import LigerRopeFunction

        return LigerRopeFunction.apply(q, k, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, liger: bool) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up`."""
    if liger:
        # optional dependency (keel[liger]); only on the liger path
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply(gate, up)
    return F.silu(gate) * up


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    label_smoothing: float,
    z_loss: float,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean over non-ignored tokens of `cross_entropy_reference(hidden @ weight[:vocab_size].T, labels)` by
    Liger's chunked kernel; the padding rows of the (padded) head are sliced off, so they get no gradient.
    Gradients accumulate in fp32 whatever the weight's dtype (many chunks add into one weight gradient)."""
    # optional dependency (keel[liger]); only on the liger path
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    loss, *_ = LigerFusedLinearCrossEntropyFunction.apply(
        hidden.flatten(0, -2),
        weight[:vocab_size],
        labels.flatten(),
        None,
        None,
        ignore_index,
        z_loss,
        label_smoothing,
        "mean",
        None,
        False,
        torch.float32,
    )
    return loss
