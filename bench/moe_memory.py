"""What an MoE layer's grouped GEMM keeps for backward: Keel's `_GroupedSwiGLU` against autograd's own.

    python bench/moe_memory.py [--experts 8] [--dim 1024] [--hidden 2816] [--tokens 4096] [--repeats 3]

Autograd's version stacks every local expert's weights and lets `grouped_mm` save the stacks; Keel's saves
references to the weights and restacks in backward. Prints, for one MoE layer's expert MLPs in fp32 on CPU: the
bytes each keeps from forward to backward (saved tensors not already held as parameters, counted by storage), the
local expert weights' bytes, and forward+backward wall time of each, interleaved A/B (the restack's cost).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from keel.model.moe import _GroupedSwiGLU  # noqa: E402


def autograd_grouped(inputs, offsets, experts, *weights):
    """The pre-issue-27 path: stacks kept by autograd."""
    w13 = torch.stack(weights[:experts]).flatten(1, -2)
    w2 = torch.stack(weights[experts:])
    gate, up = F.grouped_mm(inputs, w13.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    return F.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)


def kept_bytes(fn, inputs, offsets, experts, weights) -> int:
    """Bytes of the distinct storages saved for backward that are not the parameters'."""
    params = {w.untyped_storage().data_ptr() for w in weights}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(inputs, offsets, experts, *weights)
    return sum(seen.values())


def timed(fn, inputs, offsets, experts, weights) -> float:
    start = time.perf_counter()
    out = fn(inputs, offsets, experts, *weights)
    out.backward(
        torch.ones_like(out)
    )  # a real tensor: torch's own grouped_mm backward refuses an expanded one
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2816)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    e, dim, hidden = args.experts, args.dim, args.hidden
    weights = [torch.randn(2, hidden, dim, requires_grad=True) for _ in range(e)]
    weights += [torch.randn(dim, hidden, requires_grad=True) for _ in range(e)]
    counts = torch.full((e,), args.tokens // e)
    offsets = counts.cumsum(0).to(torch.int32)
    inputs = torch.randn(int(counts.sum()), dim, requires_grad=True)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    ours = kept_bytes(_GroupedSwiGLU.apply, inputs, offsets, e, weights)
    theirs = kept_bytes(autograd_grouped, inputs, offsets, e, weights)
    times: dict[str, list[float]] = {"keel": [], "autograd": []}
    for _ in range(args.repeats):  # interleaved A/B
        times["autograd"].append(timed(autograd_grouped, inputs, offsets, e, weights))
        times["keel"].append(timed(_GroupedSwiGLU.apply, inputs, offsets, e, weights))
    print(
        f"{e} experts, dim {dim}, hidden {hidden}, {int(counts.sum())} rows, fp32, torch {torch.__version__}"
    )
    print(f"local expert weights:          {weight_bytes / 2**20:9.1f} MiB")
    print(f"kept for backward (autograd):  {theirs / 2**20:9.1f} MiB")
    print(f"kept for backward (keel):      {ours / 2**20:9.1f} MiB")
    print(
        f"saved: {(theirs - ours) / 2**20:.1f} MiB = {(theirs - ours) / weight_bytes:.2f} x the weights"
    )
    a, k = statistics.median(times["autograd"]), statistics.median(times["keel"])
    print(f"forward+backward median: autograd {a:.3f} s, keel {k:.3f} s, keel/autograd {k / a:.2f}")


if __name__ == "__main__":
    main()
