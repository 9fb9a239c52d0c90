"""One layout's prediction: memory per rank, step time by term, tokens/s per device and MFU.

Memory is the memory model's (keel/engine/memory_model.py: model state, activations in flight, transients). Step
time adds, for the busiest pipeline rank:
- compute: each GEMM of Keel's block (q, k|v, o, gate|up, down; the head on the last stage; an MoE block's experts
  at top-k tokens) forward, backward (2×) and recomputed (checkpointing) at the device's peak × that GEMM's
  efficiency (devices.py), plus causal attention (4·s·d per token and layer, halved);
- communication: each collective's bytes over its link's bandwidth plus a fixed cost per call (the device's
  latency), counted per layout —
  - tensor parallel: 2 all-reduces (Megatron SP: reduce-scatter + all-gather, the same bytes) per block forward
    and 2 backward, ring volume 2(t−1)/t, not overlapped;
  - Ulysses sequence parallel: 4 all-to-alls per block each way, (s−1)/s of their bytes;
  - context parallel: the ring's K/V past cp−1 ranks per block forward and again (with dK/dV) backward, the part
    the block's attention does not hide;
  - expert parallel: dispatch and combine all-to-alls per MoE block each way;
  - data parallel as DeepSpeed moves it (`_data_parallel_seconds`: ZeRO-2 and -3 every micro-batch) over the
    ranks replicating the parameters (data × cp × sp), at the slower link the group spans, overlapped with
    backward where `overlap_comm` is on and the device overlaps;
- the pipeline's bubble from its schedule (1F1B (pp−1)/m, interleaved (pp−1)/(m·v), DualPipeV (pp/2−1)/m of
  the micro-batches' time) and its point-to-point transfers;
- the optimizer's update (memory-bound: ~32 bytes read and written per parameter it holds) and a host overhead.
MFU is model FLOPs (6·N per token plus attention, or without it: both printed, named) over step time × peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from keel.config import RunConfig
from keel.engine.ds_config import precision, zero_stage
from keel.engine.memory_model import LayerCut, Layout, RankMemory, estimate
from keel.model.router import is_moe_block
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
    cp: int | None = None,
) -> Prediction:
    """`cut`: the memory model's layer cut for this layout's tp, ep, pp and schedule, when made already. `cp`:
    overrides `parallel.cp` (bench/plan_accuracy.py's published anchors). Under context parallelism each rank
    takes 1/cp of every sequence, its K/V travel the cp ring once per block each way (overlapped with the
    attention they feed), and the cp ranks reduce gradients with the data-parallel ones."""
    parallel, train, model = cfg.parallel, cfg.train, cfg.model
    tp, pp, sp, ep = parallel.tp, parallel.pp, parallel.sp, parallel.ep
    cp = parallel.cp if cp is None else cp
    dp = gpus // (tp * pp * sp * cp)
    prec, stage = precision(ds), zero_stage(ds)
    b = BYTES[prec]
    layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep, sp=sp, cp=cp)
    memory = estimate(cfg, ds, layout, cut)
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
    moe_blocks = sum(1 for i in range(model.n_layers) if is_moe_block(model, i))
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
        # CPU: a real block timed here, its elementwise ops and the framework's per-op cost included; a cp
        # rank does 1/cp of it (its tokens, and its even share of the causal attention)
        block = sum(
            share * device.timer.block_seconds(model, tp, train.micro_batch_size, s // sp, moe) / cp
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

    def link(within_node: bool) -> tuple[float, float]:
        """(bytes/s, seconds a call) of the link a group meets: within a node or across nodes."""
        if within_node:
            return device.intra_gbps * 1e9, device.intra_latency_us * 1e-6
        return device.inter_gbps * 1e9, device.inter_latency_us * 1e-6

    def moved(volume: float, calls: float, within_node: bool) -> float:
        bandwidth, latency = link(within_node)
        return volume / bandwidth + calls * latency

    # forward and backward's collectives, and a recomputed forward's again
    passes = 1 + recompute / 2
    activation = tokens * h * b  # one micro-batch's hidden states on a rank
    tp_comm = 0.0
    if tp > 1:
        # 2 all-reduces per block forward, 2 backward; the vocabulary-parallel embedding and loss add ~5
        calls = (4 * blocks_on_rank * passes + 5) * micro_batches
        volume = 2 * (tp - 1) / tp * activation * (4 * blocks_on_rank * passes + 2) * micro_batches
        tp_comm = moved(volume, calls, tp <= gpus_per_node)
    sp_comm = 0.0
    if sp > 1:
        # Ulysses: q, k, v and the output, each way, per block
        calls = 8 * blocks_on_rank * passes * micro_batches
        volume = (sp - 1) / sp * tokens * (2 * q + 2 * kv) * b * 2 * blocks_on_rank * passes
        sp_comm = moved(volume * micro_batches, calls, tp * sp <= gpus_per_node)
    ep_comm = 0.0
    if ep > 1 and moe_blocks:
        # dispatch and combine all-to-alls per MoE block each way, top-k copies of each token
        moe_on_rank = moe_share * blocks_on_rank
        calls = 4 * moe_on_rank * passes * micro_batches
        volume = (ep - 1) / ep * activation * model.moe_top_k * calls
        ep_comm = moved(volume, calls, tp * ep <= gpus_per_node)
    cp_comm = 0.0
    if cp > 1:
        bandwidth, latency = link(tp * sp * cp <= gpus_per_node)  # the grid: cp outside sp and tp
        ring = (cp - 1) * (tokens * 2 * kv * b / bandwidth + latency)
        overlap = attend(tokens, model.head_dim, s // 2) * (q // model.head_dim)
        cp_comm = 3 * blocks_on_rank * micro_batches * max(ring - overlap, 0.0)
    dp_comm = _data_parallel_seconds(
        cfg,
        ds,
        memory,
        layout.zero_group,
        micro_batches,
        b,
        moved,
        tp * sp * dp * cp <= gpus_per_node,
    )
    if dp_comm:
        overlap_comm = ds.get("zero_optimization", {}).get("overlap_comm", stage == 3)
        backward = compute * 2 / 3
        dp_comm = max(dp_comm - (device.overlap if overlap_comm else 0.0) * backward, 0.0)
    bubble = 0.0
    if pp > 1:
        schedule = parallel.pipeline_schedule
        chunks = parallel.virtual_stages if schedule == "interleaved" else 1
        if schedule == "interleaved":
            idle = (pp - 1) / chunks
        elif schedule == "dualpipev":
            idle = max(pp / 2 - 1, 0)
        else:
            idle = pp - 1
        bubble = idle * per_micro
        # a micro-batch's activations forward and their gradients back, at each of the rank's stage edges
        transfers = 2 * micro_batches * chunks
        bubble += moved(transfers * activation, transfers, gpus <= gpus_per_node)
    held = memory.share.total / (layout.zero_group if stage >= 1 else 1)
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
            "ep comm": ep_comm,
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


def _data_parallel_seconds(
    cfg: RunConfig,
    ds: dict,
    memory: RankMemory,
    group: int,
    micro_batches: int,
    b: int,
    moved: Callable[[float, float, bool], float],
    near: bool,
) -> float:
    """The data-parallel group's gradient and parameter traffic in one step, as DeepSpeed moves it. ZeRO 0-1
    reduce the accumulated gradients once (per bucket) and ZeRO-1 gathers the updated partitions; ZeRO-2
    reduce-scatters every micro-batch's gradients as backward makes them, then gathers once; ZeRO-3 also
    gathers each module's partitioned parameters for its forward and again for its backward, every
    micro-batch (parameters under `stage3_param_persistence_threshold` stay whole on every rank)."""
    if group <= 1:
        return 0.0
    zero = ds.get("zero_optimization", {})
    stage = zero_stage(ds)
    params = memory.share.total
    share = (group - 1) / group  # of the bytes a rank sends in a reduce-scatter or an all-gather
    bucket = int(zero.get("reduce_bucket_size", 5e8))
    buckets = max(1, -(-params // bucket))
    if stage <= 1:
        return moved(2 * share * params * b, buckets + (buckets if stage == 1 else 0), near)
    seconds = moved(micro_batches * share * params * b, micro_batches * buckets, near)
    if stage == 2:
        seconds += moved(share * params * b, buckets, near)  # the updated partitions, gathered
    else:
        sizes = _module_sizes(cfg)
        threshold = int(zero.get("stage3_param_persistence_threshold", 1e5))
        gathered = [n for n in sizes if n > threshold]
        volume = 2 * micro_batches * share * sum(gathered) * b * memory.share.total / sum(sizes)
        seconds += moved(volume, 2 * micro_batches * len(gathered), near)
    return seconds


def _module_sizes(cfg: RunConfig) -> list[int]:
    """Each parameter-holding module's element count (whole model, before any split): the units ZeRO-3
    gathers."""
    model = cfg.model
    h, q, kv = model.dim, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    sizes = [model.vocab_size * h, h, h * model.vocab_size]  # embedding, final norm, head
    for i in range(model.n_layers):
        moe = is_moe_block(model, i)
        ffn = (model.moe_ffn_hidden or model.ffn_dim) if moe else model.ffn_dim
        experts = model.moe_experts if moe else 1
        sizes += [h, h * q, 2 * h * kv, q * h, h, experts * 2 * h * ffn, experts * ffn * h]
        if moe:
            sizes.append(h * model.moe_experts)  # the router
    return sizes


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
        moe = is_moe_block(model, i)
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
