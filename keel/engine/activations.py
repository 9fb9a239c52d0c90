"""Activation memory: the bytes autograd keeps from a micro-batch's forward until its backward, per rank.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4) count what each op
of a GPT layer saves; this is the same count for Keel's own layers (keel/model/layers.py, kernels.py), as torch
saves it. For one block and T tokens of width h on a rank (bytes b of the run's precision; heads and the MLP's
width split over tp, tokens over Ulysses sp; the norms' tokens over tp too under Megatron SP):

    attention  RMSNorm's fp32 input (4·T·h: it upcasts; at fp32 the input itself), its normalized input (b·T·h,
               kept for the weight's gradient) and its output (b·T·h, also the projections' input); the fused
               k|v projection's output (b·T·2·kv), RoPE'd q and k (b·T·(q + kv); RoPE multiplies by constant
               tables and keeps nothing else), SDPA's output (b·T·q: Keel hands SDPA its heads transposed from
               (batch, s, heads, d), the output comes back in that layout and wo's input is a view of it) and
               its log-sum-exp (fp32, per head and token). Memory-efficient attention (flash on GPU, and
               torch's CPU kernel) keeps no s×s scores; but with packed documents masked
               (`data.document_mask`) SDPA turns the boolean [s, s] mask into an additive one in the run's
               dtype and keeps it, every block: b·micro_batch·s² (and the boolean one, micro_batch·s², lives as
               long as the micro-batch's activations).
    MLP        RMSNorm as above; w13's gate|up output (b·T·2·f), silu(gate) (b·T·f) and the product, w2's input
               (b·T·f).
    dropout    a byte per element of each branch output when model.dropout > 0.

The head (the final norm, the logits and the loss) keeps the norm as above and the logits: b·T·V for the
projection's output plus the loss's fp32 log-probabilities (4·T·V), V the rank's vocabulary shard — the largest
single term at a large vocabulary. A fused linear + cross-entropy (Liger) keeps no logits.

Context parallelism (`parallel.cp`) splits every sequence over cp ranks (two chunks of s/(2·cp) each,
keel/parallel/context.py), so every count above is at T = micro_batch·s/(cp·sp) tokens: outside attention every
layer is position-wise, and the ring (keel/parallel/ring_attention.py) saves exactly what SDPA does (the rank's
RoPE'd q, k, v, its output and log-sum-exp). Its blocks are c×c with c = s/(2·cp), on a memory-efficient kernel
(SDPA's CPU flash) that keeps no scores, as above, and no [s, s] document mask: it builds each pair of chunks'
c×c mask as it attends them. What cp adds is short-lived, one block's attention at a time (`ring_bytes`): other
ranks' K/V in flight and, in backward, the dK/dV travelling with them in fp32.

Activation checkpointing every N blocks (`train.activation_checkpoint_interval`) keeps each chunk's input (b·T·h)
and, in backward, one chunk's full activations while it is recomputed. A pipeline stage keeps the activations of
the micro-batches it has run forward and not yet backward: the schedule's peak in flight
(`in_flight`). tests/test_activations.py holds the count against what torch saves.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.config import ModelConfig

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ActivationShape:
    """What decides a block's activations on one rank."""

    micro_batch: int
    seq_len: int
    precision: str = "fp32"
    tp: int = 1
    sp: int = 1  # Ulysses: tokens split outside attention, heads inside it
    sequence_parallel: bool = False  # Megatron SP: the norms' tokens split over tp
    cp: int = 1  # context parallel: tokens split everywhere, attention a ring over the cp ranks
    document_mask: bool = False  # data.document_mask: attention masked to each packed document

    @property
    def tokens(self) -> int:
        """The rank's tokens of one micro-batch outside attention."""
        return self.micro_batch * self.seq_len // (self.cp * self.sp)


def block_bytes(cfg: ModelConfig, shape: ActivationShape, moe: bool = False) -> int:
    """Bytes one transformer block keeps for one micro-batch (nothing recomputed)."""
    b, t, h = BYTES[shape.precision], shape.tokens, cfg.dim
    norm_tokens = t // shape.tp if shape.sequence_parallel else t
    q = cfg.n_heads * cfg.head_dim // shape.tp
    kv = max(1, cfg.n_kv_heads // shape.tp) * cfg.head_dim
    heads = cfg.n_heads // shape.tp
    # RMSNorm: its fp32 input (the input itself at fp32), its normalized input and its output; under SP the
    # output is gathered to t
    norm = norm_tokens * h * (4 + b) + (t if shape.sequence_parallel else norm_tokens) * h * b
    # k|v, RoPE'd q and k, SDPA's output (wo's input is a view of it)
    attention = norm + b * t * (2 * kv + q + kv + q) + 4 * t * heads
    if shape.document_mask and shape.cp == 1:
        # SDPA's additive [s, s] mask, whole on every tp rank (under cp the ring builds c×c ones)
        attention += b * shape.micro_batch * shape.seq_len**2
    if cfg.qk_norm:
        attention += t * (q + kv) * (4 + b)
    if moe:
        mlp = norm + _moe_mlp_bytes(cfg, shape, t)
    else:
        f = cfg.ffn_dim // shape.tp
        mlp = norm + b * t * 4 * f
    dropout = 2 * norm_tokens * h if cfg.dropout > 0 else 0
    return attention + mlp + dropout


def _moe_mlp_bytes(cfg: ModelConfig, shape: ActivationShape, t: int) -> int:
    """An MoE block's feed-forward: the router's fp32 input, logits and probabilities, each token's top-k expert MLPs
    (gate|up, silu, product as in the dense MLP, at the experts' width), three rows of width h per routed token —
    the gathered input, the experts' output (kept by the multiply by its routing weight) and the weighted output
    (kept by the index_add that combines them) — and a shared expert when there is one."""
    b, h = BYTES[shape.precision], cfg.dim
    f = (cfg.moe_ffn_hidden or cfg.ffn_dim) // shape.tp
    routed = t * cfg.moe_top_k
    experts = b * routed * (4 * f + 3 * h)
    # the router scores in fp32: its upcast input (at fp32, the norm's output itself), logits and probabilities
    router = 4 * t * cfg.moe_experts * 2 + (4 * t * h if b != 4 else 0)
    shared = b * t * 4 * (cfg.ffn_dim // shape.tp) if cfg.moe_shared_expert else 0
    return experts + router + shared


def head_bytes(cfg: ModelConfig, shape: ActivationShape, vocab_shard: int, fused_loss: bool) -> int:
    """The final norm, the logits and the loss of one micro-batch on the last stage."""
    b, t, h = BYTES[shape.precision], shape.tokens, cfg.dim
    norm = t * h * (4 + 2 * b)  # as a block's
    return norm if fused_loss else norm + t * vocab_shard * (b + 4)


def ring_bytes(cfg: ModelConfig, shape: ActivationShape) -> int:
    """The context-parallel ring's buffers in one block's attention at their peak, backward (0 without cp): other
    ranks' K/V in hand and arriving (one at cp = 2, two beyond: a receive buffer the size of the local K and V
    each), the fp32 dK/dV accumulating, the previous ones still being sent and the next arriving, the fp32
    dq, and under document masking one pair of chunks' c×c mask (boolean and additive). Forward holds less (the
    K/V and an fp32 output). Freed after each block, never kept across blocks."""
    if shape.cp == 1:
        return 0
    b, t = BYTES[shape.precision], shape.tokens
    c = shape.seq_len // (2 * shape.cp)
    mask = (1 + b) * shape.micro_batch * c * c if shape.document_mask else 0
    q = cfg.n_heads * cfg.head_dim // shape.tp
    kv_heads = max(1, cfg.n_kv_heads // shape.tp)
    # Ulysses sends a kv head per query head when sp does not divide the kv heads (keel/model/layers.py); the
    # all-to-all keeps the element count: s/cp tokens of width/sp inside attention, T tokens of width outside
    kv = (kv_heads if kv_heads % shape.sp == 0 else cfg.n_heads // shape.tp) * cfg.head_dim
    in_flight_kv = min(2, shape.cp - 1)
    return in_flight_kv * b * t * 2 * kv + 3 * 4 * t * 2 * kv + 4 * t * q + mask


def checkpointed_bytes(blocks: int, interval: int, block: int, block_input: int) -> int:
    """`blocks` blocks of `block` bytes each, checkpointed every `interval` (0: not at all): the chunks' inputs,
    plus one chunk's activations while backward recomputes it."""
    if not interval or interval >= blocks:
        return blocks * block
    chunks = -(-blocks // interval)
    return chunks * block_input + interval * block


def in_flight(schedule: str, pp: int, micro_batches: int, rank: int, chunks: int = 2) -> float:
    """Micro-batches of pipeline rank `rank`'s whole share it holds at its peak: one without a pipeline; 1F1B's
    warm-up depth min(pp − rank, m); interleaved 1F1B's peak of forwarded-not-yet-backwarded chunks (Megatron's
    warm-up plus the first steady forward), over its `chunks` chunks; DualPipeV's (pp + 1) chunks of half a rank's
    layers (DeepSeek-V3 report, table 2), over its two."""
    if pp == 1:
        return 1.0
    if schedule == "interleaved":
        from keel.engine.interleaved_schedule import warmup_forwards

        warmup = warmup_forwards(pp, micro_batches, chunks, rank)
        # the warm-up's forwards, then each steady forward before its backward
        return (warmup + (warmup < micro_batches * chunks)) / chunks
    if schedule == "dualpipev":
        return min(pp + 1, 2 * micro_batches) / 2
    return float(min(pp - rank, micro_batches))


def rank_activation_bytes(
    cfg,
    shape: ActivationShape,
    blocks: list[tuple[int, bool]],
    has_head: bool,
    flight: float,
    vocab_shard: int,
) -> int:
    """A pipeline rank's activation peak: its blocks ((layer id, is MoE) each), checkpointed every
    `train.activation_checkpoint_interval`, and its head when it is the last stage, times the micro-batches in
    flight; with packed documents masked and no cp, each micro-batch's boolean [s, s] mask too (alive through
    the forward, and through backward under checkpointing, which recomputes the blocks from it)."""
    interval = cfg.train.activation_checkpoint_interval
    dense = [block_bytes(cfg.model, shape, moe) for _, moe in blocks]
    block_input = BYTES[shape.precision] * shape.tokens * cfg.model.dim
    if dense:
        average = sum(dense) // len(dense)
        kept = checkpointed_bytes(len(dense), interval, average, block_input)
    else:
        kept = 0
    fused = cfg.model.kernels == "liger" and shape.tp == 1
    head = head_bytes(cfg.model, shape, vocab_shard, fused) if has_head else 0
    mask = (
        shape.micro_batch * shape.seq_len**2
        if shape.document_mask and shape.cp == 1 and dense
        else 0
    )
    return int((kept + head + mask) * flight)
