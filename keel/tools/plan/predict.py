"""One layout's prediction: memory per rank, step time by term, tokens/s per device and MFU.

Memory is the memory model's (keel/engine/memory_model.py: model state, activations in flight, transients). Step
time adds, for the busiest pipeline rank:
- compute: each GEMM of Keel's block (q, k|v, o, gate|up, down; the head on the last stage; an MoE block's experts
  at top-k tokens) forward, backward (2×) and recomputed (checkpointing) at the device's peak × that GEMM's
  efficiency (devices.py), plus causal attention (4·s·d per token and layer, halved);
- tensor-parallel communication: 2 all-reduces (Megatron SP: reduce-scatter + all-gather, the same bytes) per block
  forward and 2 backward, ring volume 2(t−1)/t, not overlapped;
- Ulysses sequence parallel: 4 all-to-alls per block each way, (s−1)/s of their bytes;
- data-parallel gradient reduction (ZeRO 0-2: all-reduce volume; ZeRO-3 adds the parameters' two all-gathers),
  at the slower link the data-parallel group spans, overlapped with backward where `overlap_comm` is on;
- the pipeline's bubble from its schedule (1F1B (pp−1)/m, interleaved (pp−1)/(m·v), DualPipeV (pp/2−1)/m of
  the micro-batches' time) and its point-to-point activations;
- the optimizer's update (memory-bound: ~32 bytes read and written per parameter it holds) and a host overhead.
MFU is model FLOPs (6·N per token plus attention, or without it: both printed, named) over step time × peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from keel.config import RunConfig
from keel.engine.ds_config import precision, zero_stage
from keel.engine.memory_model import LayerCut, Layout, RankMemory, estimate
from keel.tools.plan.devices import Device

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OVERHEAD_S = {"gpu": (2e-5, 5e-3), "cpu": (1e-3, 1e-2)}  # (per block and micro-batch, per step)
FIT_FRACTION = (
    0.9  # of device (or host) memory: the allocator's fragmentation and the framework's own buffers
)


@dataclass
class Prediction:
    layout: dict[str, int | str]
    memory: RankMemory
    memory_limit: int  # bytes a rank may use
    terms: dict[str, float] = field(default_factory=dict)  # seconds per step by term
    tokens_per_step: int = 0
    gpus: int = 1
    model_flops: float = 0.0  # per step, with attention
    model_flops_no_attention: float = 0.0
    peak_tflops: float = 1.0
    overrides: list[str] = field(default_factory=list)  # what makes `keel train` run this layout
    ds: dict = field(default_factory=dict)  # its DeepSpeed JSON

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.memory_limit

    @property
    def step_s(self) -> float:
        return sum(self.terms.values())

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_step / self.step_s / self.gpus

    def mfu(self, attention: bool = True) -> float:
        flops = self.model_flops if attention else self.model_flops_no_attention
        return flops / (self.step_s * self.gpus * self.peak_tflops * 1e12)

    @property
    def binding(self) -> str:
        """What limits this plan: memory when within 5 % of the limit, else its largest time term."""
        if self.memory.peak > 0.95 * self.memory_limit:
            return "memory"
        return max(self.terms, key=self.terms.get)


def predict(
    cfg: RunConfig,
    ds: dict,
    gpus: int,
    gpus_per_node: int,
    device: Device,
    cut: LayerCut | None = None,
    cp: int = 1,
) -> Prediction:
    """`cut`: the memory model's layer cut for this layout's tp, ep, pp and schedule, when made already. `cp`:
    context parallelism, modelled analytically (Keel does not run it yet): each rank takes 1/cp of every
    sequence, its K/V travel the cp ring once per block each way (overlapped with the attention they feed), and
    the cp ranks reduce gradients with the data-parallel ones."""
    parallel, train, model = cfg.parallel, cfg.train, cfg.model
    tp, pp, sp, ep = parallel.tp, parallel.pp, parallel.sp, parallel.ep
    dp = gpus // (tp * pp * sp * cp)
    prec, stage = precision(ds), zero_stage(ds)
    b = BYTES[prec]
    memory = estimate(cfg, ds, Layout(tp=tp, pp=pp, dp=dp * cp, ep=ep, sp=sp), cut)
    per_node = min(gpus, gpus_per_node)
    limit = device.memory_gib * 2**30 * FIT_FRACTION / (per_node if device.is_cpu else 1)
    micro_batches = train.global_batch_size // (train.micro_batch_size * dp)
    tokens = train.micro_batch_size * cfg.data.seq_len // (sp * cp)  # per rank and micro-batch
    seconds = _gemm_timer(device, prec)
    attend = _attention_timer(device, prec, seconds)

    h, s = model.dim, cfg.data.seq_len
    q = model.n_heads * model.head_dim // tp
    kv = max(1, model.n_kv_heads // tp) * model.head_dim
    f = model.ffn_dim // tp
    vocab = -(-model.vocab_size // tp)
    blocks_on_rank = -(-model.n_layers // pp)
    moe_blocks = sum(
        1 for i in range(model.n_layers) if model.moe_experts and (i + 1) % model.moe_every == 0
    )
    moe_share = moe_blocks / model.n_layers
    expert_f = (model.moe_ffn_hidden or model.ffn_dim) // tp

    def block_forward() -> float:
        attention = seconds(tokens, h, q) + seconds(tokens, h, 2 * kv) + seconds(tokens, q, h)
        # causal attention core: QKᵀ and AV of each local head over the whole sequence, half of it masked
        attention += attend(tokens, model.head_dim, s // 2 * sp) * (q // model.head_dim) / sp
        dense = seconds(tokens, h, 2 * f) + seconds(tokens, f, h)
        routed = tokens * model.moe_top_k
        experts = seconds(routed, h, 2 * expert_f) + seconds(routed, expert_f, h)
        if model.moe_shared_expert:
            experts += dense
        return attention + (1 - moe_share) * dense + moe_share * experts

    recompute = 1 if train.activation_checkpoint_interval else 0
    if device.is_cpu:
        # CPU: a real block timed here, its elementwise ops and the framework's per-op cost included
        block = sum(
            share * device.timer.block_seconds(model, tp, train.micro_batch_size, s // sp, moe)
            for share, moe in ((1 - moe_share, False), (moe_share, True))
            if share
        )
        per_micro = blocks_on_rank * block * (3 + recompute) / 3
    else:
        per_micro = blocks_on_rank * block_forward() * (3 + recompute)
    per_micro += 3 * seconds(
        tokens, h, vocab
    )  # the head (last stage; the first holds the embedding)
    compute = per_micro * micro_batches

    intra, inter = device.intra_gbps * 1e9, device.inter_gbps * 1e9
    tp_bw = intra if tp <= gpus_per_node else inter
    tp_comm = 0.0
    if tp > 1:
        volume = 2 * (tp - 1) / tp * tokens * h * b
        tp_comm = 4 * blocks_on_rank * micro_batches * volume / tp_bw * (1 + recompute / 2)
    sp_comm = 0.0
    if sp > 1:
        volume = (sp - 1) / sp * tokens * (2 * q + 2 * kv) * b
        sp_comm = (
            2
            * blocks_on_rank
            * micro_batches
            * volume
            / (intra if tp * sp <= gpus_per_node else inter)
        )
    cp_comm = 0.0
    if cp > 1:
        ring = (cp - 1) * tokens * 2 * kv * b / (intra if tp * cp <= gpus_per_node else inter)
        overlap = attend(tokens, model.head_dim, s // 2) * (q // model.head_dim)
        cp_comm = 3 * blocks_on_rank * micro_batches * max(ring - overlap, 0.0)
    dp_comm = 0.0
    if dp * cp > 1:
        params = memory.share.total
        group = dp * cp
        volume = 2 * (group - 1) / group * params * b * (1.5 if stage == 3 else 1.0)
        dp_bw = intra if tp * sp * group <= gpus_per_node else inter
        overlap = 0.7 if ds.get("zero_optimization", {}).get("overlap_comm", stage == 3) else 0.0
        backward = compute * 2 / 3
        dp_comm = max(volume / dp_bw - overlap * backward, 0.0)
    bubble = 0.0
    if pp > 1:
        schedule = parallel.pipeline_schedule
        if schedule == "interleaved":
            idle = (pp - 1) / parallel.virtual_stages
        elif schedule == "dualpipev":
            idle = max(pp / 2 - 1, 0)
        else:
            idle = pp - 1
        bubble = idle * per_micro
        bubble += 2 * micro_batches * tokens * h * b / (inter if gpus > gpus_per_node else intra)
    held = memory.share.total / (dp if stage >= 1 else 1)
    optimizer = 32 * held / (device.hbm_tbps * 1e12)
    per_block, per_step = OVERHEAD_S["cpu" if device.is_cpu else "gpu"]
    overhead = per_block * blocks_on_rank * micro_batches + per_step

    tokens_per_step = train.global_batch_size * s
    active = _active_params(cfg)
    attention_flops = (
        6 * model.n_layers * s * model.n_heads * model.head_dim
    )  # 12·L·s·d, causal half
    return Prediction(
        layout={
            "tp": tp,
            "pp": pp,
            "dp": dp,
            "sp": sp,
            "cp": cp,
            "ep": ep,
            "zero": stage,
            "micro_batch": train.micro_batch_size,
            "checkpointing": train.activation_checkpoint_interval,
            "schedule": parallel.pipeline_schedule if pp > 1 else "-",
        },
        memory=memory,
        memory_limit=int(limit),
        terms={
            "compute": compute,
            "tp comm": tp_comm,
            "sp comm": sp_comm,
            "cp comm": cp_comm,
            "dp comm": dp_comm,
            "bubble": bubble,
            "optimizer": optimizer,
            "overhead": overhead,
        },
        tokens_per_step=tokens_per_step,
        gpus=gpus,
        model_flops=(6 * active + attention_flops) * tokens_per_step,
        model_flops_no_attention=6 * active * tokens_per_step,
        peak_tflops=device.bf16_tflops,
    )


def _active_params(cfg: RunConfig) -> int:
    """Parameters a token passes through (an MoE block's top-k experts only), the head included, the embedding
    lookup not (it multiplies nothing)."""
    model = cfg.model
    h, q, kv = model.dim, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    attention = h * (q + 2 * kv) + q * h
    dense = 3 * h * model.ffn_dim
    expert = 3 * h * (model.moe_ffn_hidden or model.ffn_dim)
    per_layer = []
    for i in range(model.n_layers):
        moe = model.moe_experts and (i + 1) % model.moe_every == 0
        ffn = model.moe_top_k * expert + (dense if model.moe_shared_expert else 0) if moe else dense
        per_layer.append(attention + ffn)
    return sum(per_layer) + h * model.vocab_size


ATTENTION_EFFICIENCY = (
    0.45  # of the dense peak: FlashAttention-2's forward and backward on an H100, about
)


def _attention_timer(device: Device, prec: str, seconds):
    """attend(tokens, head_dim, keys): one head's QKᵀ and AV (two GEMMs' FLOPs)."""
    if device.is_cpu:
        return lambda t, d, keys: 2 * seconds(t, d, keys)
    peak = device.bf16_tflops * 1e12 * (1.0 if prec != "fp32" else 0.5)
    return lambda t, d, keys: 4 * t * d * keys / (peak * ATTENTION_EFFICIENCY)


def _gemm_timer(device: Device, prec: str):
    """seconds(m, k, n) for an m×k @ k×n GEMM on `device`."""
    if device.is_cpu:
        return device.timer.gemm_seconds
    peak = (
        device.bf16_tflops * 1e12 * (1.0 if prec != "fp32" else 0.5)
    )  # fp32 runs TF32 at half the bf16 rate

    def seconds(m: int, k: int, n: int) -> float:
        return 2 * m * k * n / (peak * device.gemm_efficiency(min(k, n), m))

    return seconds
