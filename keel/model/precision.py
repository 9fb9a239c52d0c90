"""`model.fp8`: which of the model's linears compute in FP8 or an MX format, and the line that says so.

The blocks' projections (wq, the fused wkv, wo, the fused w13, w2, and an MoE layer's shared expert) take the
recipe; the embedding, the output head, the norms and the router stay in high precision, as in every published
FP8 recipe (their error reaches every token), and so do the routed experts: their FP8 GEMMs are torchao's grouped
kernels for CUDA, and a per-expert FP8 GEMM would take its scales over the tokens routed to that rank, which
would tie the model's numerics to the ep layout. `model.fp8_skip_blocks` keeps the first and last N blocks in
high precision (the common recipe for the most sensitive blocks).
"""

from __future__ import annotations

import torch

from keel.config import ModelConfig
from keel.parallel.float8 import Float8Spec, emulated
from keel.parallel.layer_parallel import LayerParallel

FP8_LINEARS = ("wq", "wkv", "wo", "w13", "w2")


def fp8_blocks(cfg: ModelConfig) -> range:
    """The blocks (layer_id) whose linears take `model.fp8` (empty when it is off)."""
    if cfg.fp8 == "off":
        return range(0)
    return range(cfg.fp8_skip_blocks, cfg.n_layers - cfg.fp8_skip_blocks)


def block_fp8(cfg: ModelConfig, layer_id: int, parallel: LayerParallel) -> Float8Spec | None:
    """The recipe of block `layer_id`'s linears (None: high precision). Under Ulysses sp and context parallel cp
    the linears see this rank's tokens, so the cp × sp group splits their tokens."""
    if layer_id not in fp8_blocks(cfg):
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = parallel.seq.group if parallel.seq.size > 1 else None
    return Float8Spec(cfg.fp8, emulate=emulated(device, cfg.fp8), tokens=tokens)


def fp8_line(cfg: ModelConfig, tp: int = 1) -> str | None:
    """What the start-up log says of `model.fp8` at tensor parallelism `tp`: the FP8 layers and those that stay
    in high precision."""
    blocks = fp8_blocks(cfg)
    if not blocks:
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = "emulated" if emulated(device, cfg.fp8) else "on FP8 tensor cores"
    shared = ", the shared expert" if cfg.moe_experts and cfg.moe_shared_expert else ""
    kept = ["embedding", "output head", "norms"]
    linears = FP8_LINEARS
    if cfg.n_kv_heads % tp:  # keel/model/layers.py Attention: replicated kv heads
        linears = tuple(name for name in linears if name != "wkv")
        kept.append(f"wkv (kv heads replicated over tp={tp})")
    if cfg.moe_experts:
        kept += ["router", "routed experts"]
    if len(blocks) < cfg.n_layers:
        skipped = [i for i in range(cfg.n_layers) if i not in blocks]
        kept.append(f"blocks {','.join(map(str, skipped))} (model.fp8_skip_blocks)")
    return (
        f"fp8 {cfg.fp8} ({mode}): blocks {blocks.start}-{blocks.stop - 1} {'/'.join(linears)}{shared}; "
        f"high precision: {', '.join(kept)}"
    )
