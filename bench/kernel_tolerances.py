"""How much of its tolerance each CUDA kernel comparison in tests/test_kernels.py uses, measured without a GPU.

The tests compare Liger's kernels with Keel's torch path on CUDA. Reductions (the fused CE's input and weight
gradients, RMSNorm's weight and input gradients) get atol = tol x the largest magnitude in the reference. That is
because a reduction's error grows with the magnitudes it sums. Elementwise results (RMSNorm's and SwiGLU's outputs,
the gradient of SwiGLU's `up`) get a per-element rtol: tol in fp32, 8u in bf16 (u = 2^-8). This prints, per
comparison, the largest error as a fraction of what the test allows ("used"). It also prints what a per-element
rtol alone would use, and the summed magnitudes over the reference's largest element.

Two sources, since Liger needs CUDA and Triton's interpreter has no bf16:
- the fused linear + CE in fp32 with Liger's own kernel under TRITON_INTERPRET=1, at the tests' three shapes
  (needs liger-kernel and triton; skipped without them; the largest takes over a minute);
- everything in fp32 and bf16 with a CPU emulation of Liger's arithmetic: fp32 inside, the inputs' dtype in and
  out, the CE's logits in chunks (Liger's chunk size) and its weight gradient summed over the chunks in that dtype.
On a GPU, `bench/device_check.sh` (gpu-tests) runs the tests themselves.

    python bench/kernel_tolerances.py
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from keel.model.kernels import rms_norm, silu_mul  # noqa: E402
from keel.parallel.cross_entropy import cross_entropy_reference  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # the tests' tol per dtype
ELEMENTWISE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 8 * 2.0**-8}
CE_SHAPES = [(300, 72, 1000), (1, 64, 128), (4096, 256, 32000)]
NORM_SHAPES = [(100, 72), (1, 64), (37, 4096)]
SMOOTHING, Z_LOSS = 0.1, 1e-4


def emulated_fused_ce(h, w, labels, vocab):
    """Liger's fused linear + CE arithmetic (liger_kernel/ops/fused_linear_cross_entropy.py) in torch."""
    rows, dim = h.shape
    chunk = min(rows, 1 << (math.ceil(rows / math.ceil(w.shape[0] / dim)) - 1).bit_length())
    grad_h, grad_w, losses = torch.zeros_like(h), torch.zeros_like(w), torch.zeros(rows)
    for start in range(0, rows, chunk):
        h_chunk, target = h[start : start + chunk], labels[start : start + chunk]
        z = (h_chunk @ w.t()).float()[:, :vocab]
        lse = torch.logsumexp(z, -1, keepdim=True)
        smooth = (1 - SMOOTHING) * F.one_hot(target, vocab).float() + SMOOTHING / vocab
        losses[start : start + chunk] = (
            lse.squeeze(-1) - (smooth * z).sum(-1)
        ) + Z_LOSS * lse.squeeze(-1) ** 2
        dz = torch.zeros(len(target), w.shape[0])
        dz[:, :vocab] = (torch.exp(z - lse) * (1 + 2 * Z_LOSS * lse) - smooth) / rows
        dz = dz.to(h.dtype)
        grad_h[start : start + chunk] = dz @ w
        grad_w += dz.t() @ h_chunk  # summed over chunks in the weight's dtype
    return losses.mean(), grad_h, grad_w


def emulated_norm_swiglu(x, w, b, eps=1e-5):
    """Liger's RMSNorm (llama casting) and SwiGLU, forward and the backward of the tests' objective."""
    xf, wf, bf = x.float(), w.float(), b.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = (xf * rstd).to(x.dtype)
    norm = (normed.float() * wf).to(x.dtype)
    sig = torch.sigmoid(xf)
    silu = xf * sig
    act = (silu * bf).to(x.dtype)
    d_norm, d_act = 1.5 * wf, 2 * act.float()  # of (norm * 1.5).sum() + (act ** 2).sum()
    dx_norm = rstd * (d_norm - xf * rstd * (d_norm * xf * rstd).mean(-1, keepdim=True))
    dx_act = d_act * (silu * (1 - sig) + sig) * bf
    grad_w = (1.5 * normed.float()).sum(0).to(x.dtype)
    return norm, act, (d_act * silu).to(x.dtype), dx_norm.to(x.dtype) + dx_act.to(x.dtype), grad_w


def usage(
    name: str, got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float, summed=None
) -> str:
    got, ref = got.float(), ref.float()
    err = (got - ref).abs()
    used = (err / (atol + rtol * ref.abs()).clamp_min(1e-38)).max().item()
    alone = (err / (rtol * ref.abs()).clamp_min(1e-38)).max().item()
    line = (
        f"  {name:<8} max|ref| {ref.abs().max().item():.2e}  max err {err.max().item():.2e}  used {used:6.1%}  "
        f"(rtol alone: {alone:.3g}x)"
    )
    if summed is not None:
        line += f"  summed magnitudes / max|ref| {summed.max().item() / ref.abs().max().item():.2f}"
    return line


def ce_case(rows, dim, vocab, dtype, fused):
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(rows, dim, generator=g).to(dtype)
    w0 = (torch.randn(vocab + 64, dim, generator=g) / dim**0.5).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    logits = h @ w.T
    logits.retain_grad()
    loss = cross_entropy_reference(logits, labels, vocab, SMOOTHING, Z_LOSS)
    loss.backward()
    dz = logits.grad.float().abs()
    summed = [None, dz @ w0.float().abs(), dz.T @ h0.float().abs()]
    got = fused(h0, w0, labels, vocab)
    tol = TOL[dtype]
    return [
        usage(name, o.detach().reshape(r.shape), r.detach(), tol, tol * r.abs().max().item(), s)
        for name, o, r, s in zip(
            ("loss", "h.grad", "w.grad"), got, (loss.reshape(1), h.grad, w.grad), summed
        )
    ]


def liger_fused(h0, w0, labels, vocab):
    from keel.model.kernels import fused_linear_cross_entropy

    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, labels, vocab, SMOOTHING, Z_LOSS)
    loss.backward()
    return loss.reshape(1), h.grad, w.grad


def main() -> int:
    if sys.argv[1:] == ["--interpreted"]:  # the child: Liger's own kernel under TRITON_INTERPRET=1
        for rows, dim, vocab in CE_SHAPES:
            print(
                f"fused linear + CE {rows}x{dim}x{vocab} float32, Liger's kernel under the Triton interpreter"
            )
            print("\n".join(ce_case(rows, dim, vocab, torch.float32, liger_fused)), flush=True)
        return 0
    for dtype in (torch.float32, torch.bfloat16):
        for rows, dim, vocab in CE_SHAPES:
            print(f"fused linear + CE {rows}x{dim}x{vocab} {str(dtype)[6:]}, emulated")
            print(
                "\n".join(
                    ce_case(
                        rows, dim, vocab, dtype, lambda h, w, y, v: emulated_fused_ce(h, w, y, v)
                    )
                )
            )
        for rows, width in NORM_SHAPES:
            print(f"RMSNorm + SwiGLU {rows}x{width} {str(dtype)[6:]}, emulated")
            g = torch.Generator().manual_seed(0)
            x0 = torch.randn(rows, width, generator=g).to(dtype)
            w0 = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
            b0 = torch.randn(rows, width, generator=g).to(dtype)
            x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
            norm, act = rms_norm(x, w, 1e-5, False), silu_mul(x, b, False)
            ((norm.float() * 1.5).sum() + (act.float() ** 2).sum()).backward()
            refs = (norm, act, b.grad, x.grad, w.grad)
            tol, rtol = TOL[dtype], ELEMENTWISE_RTOL[dtype]
            for i, (name, got, ref) in enumerate(
                zip(
                    ("norm", "act", "b.grad", "x.grad", "w.grad"),
                    emulated_norm_swiglu(x0, w0, b0),
                    refs,
                )
            ):
                elementwise = i < 3
                print(
                    usage(
                        name,
                        got,
                        ref.detach(),
                        rtol if elementwise else tol,
                        0.0 if elementwise else tol * ref.abs().max().item(),
                    )
                )
    try:
        import liger_kernel  # noqa: F401
        import triton  # noqa: F401
    except ImportError:
        print("liger-kernel/triton not installed: Liger's own kernel not measured")
        return 0
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, __file__, "--interpreted"], env=env, capture_output=True, text=True
    )
    print(proc.stdout + (proc.stderr[-2000:] if proc.returncode else ""), end="")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
