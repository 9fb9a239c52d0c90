"""What a run configuration is: its dataclasses, the values its choice fields admit, and YAML loading.

Only shape and type live here (an unknown key, a string where an integer belongs); whether the values make sense
together is `keel.config.rules`'s job. The allowed-value tuples are the single list of names: the rules check
against them, and domain modules that dispatch on a name (the norm, the LR schedule) key their tables by them.
Nothing here imports the rest of keel, so every module can import the config without a cycle.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from keel.config.coerce import ConfigError, coerce, yaml_problem
from keel.config.yaml_text import parse_yaml

# -- the values each choice field admits ------------------------------------------------------------------------
NORMS = ("rmsnorm", "layernorm")
KERNELS = ("auto", "liger", "torch")
# off, torchao's three FP8 recipes, and the two microscaling formats (keel/parallel/float8.py)
FP8_RECIPES = ("off", "tensorwise", "rowwise", "rowwise_gw_hp", "mxfp8", "mxfp4")
INITS = ("normal", "truncated_normal", "small_init")
NORM_PLACEMENTS = ("pre", "post", "sandwich")
MOE_SCORINGS = ("softmax", "sigmoid")
MOE_DROP_POLICIES = ("probability", "position")
LR_SCHEDULES = ("cosine", "linear", "constant", "inverse_sqrt", "wsd")
RAMPUP_SCALINGS = ("linear", "sqrt", "none")
SAVE_ERROR_POLICIES = ("continue", "stop")
PIPELINE_PARTITIONS = ("parameters", "uniform")  # or "type:<LayerClass>"
# 1f1b: DeepSpeed's PipelineEngine; dualpipev: its DualPipeVEngine (two stages per rank); interleaved: Megatron's
# interleaved 1F1B (parallel.virtual_stages per rank, keel/engine/interleaved_schedule.py)
PIPELINE_SCHEDULES = ("1f1b", "dualpipev", "interleaved")
PARALLEL_AXES = ("tp", "pp", "ep", "sp", "cp")
CORRUPT_STATE_TARGETS = ("exp_avg_sq", "master", "param")
SPIKE_MODES = ("window", "ema")
CHECKSUM_ACTIONS = ("stop", "restore", "warn")
WANDB_MODES = ("offline", "online", "disabled")
SYNC_DEBUG_MODES = ("", "warn")

# every choice field and the names it admits ("section.key"; model.compile and parallel.pipeline_partition also take
# aliases and type:<LayerClass>, so their own rules check them)
CHOICES: dict[str, tuple[str, ...]] = {
    "model.norm": NORMS,
    "model.init": INITS,
    "model.norm_placement": NORM_PLACEMENTS,
    "model.kernels": KERNELS,
    "model.fp8": FP8_RECIPES,
    "model.moe_scoring": MOE_SCORINGS,
    "model.moe_drop_policy": MOE_DROP_POLICIES,
    "train.lr_schedule": LR_SCHEDULES,
    "train.rampup_lr_scaling": RAMPUP_SCALINGS,
    "parallel.pipeline_schedule": PIPELINE_SCHEDULES,
    "checkpoint.on_save_error": SAVE_ERROR_POLICIES,
    "logging.sync_debug": SYNC_DEBUG_MODES,
    "stability.spike_mode": SPIKE_MODES,
    "stability.checksum_action": CHECKSUM_ACTIONS,
    "stability.wandb_mode": WANDB_MODES,
    "faults.corrupt_state_what": CORRUPT_STATE_TARGETS,
}


@dataclass
class ModelConfig:
    vocab_size: int = 0  # 0: take the tokenizer's vocabulary size
    # the tokenizer's special ids, filled in before launch (-1 before that, and for a role the tokenizer lacks);
    # an explicit value must match the tokenizer's. They travel with the model (e.g. into an exported config).
    bos_id: int = -1
    eos_id: int = -1
    pad_id: int = -1
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention; == n_heads is plain multi-head attention
    ffn_hidden: int = 0  # 0: 8/3·dim rounded up to ffn_multiple_of (the Llama rule)
    ffn_multiple_of: int = 32
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-5
    # where each block normalizes (keel/model/llama.py Block): pre (Llama) | post (the original Transformer) |
    # sandwich (pre plus a norm on each branch's output, CogView)
    norm_placement: str = "pre"
    # DeepNet (decoder-only, post-norm): residual x·(2N)^¼; v/wo/MLP init × (8N)^-¼
    deepnorm: bool = False
    qk_norm: bool = False  # RMSNorm on each head's q and k (one weight over head_dim) before RoPE: bounds the logits
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    dropout: float = 0.0
    init: str = "normal"  # normal | truncated_normal | small_init (std = sqrt(2 / (5·dim)), replacing init_std)
    init_std: float = 0.02
    # the token table's std (and a tied head's); 0: the matrices' std
    embedding_init_std: float = 0.0
    # embedding rows padded to a multiple of this × tp; padding gets no probability
    vocab_pad_multiple: int = 128
    kernels: str = "auto"  # auto (liger on CUDA when importable, else torch) | liger | torch (keel/model/kernels.py)
    # torch.compile each block (torchtitan's per-block scheme): auto (where measured faster: CPU, fp32, dense,
    # tp = pp = sp = 1, ZeRO 0-2; keel/engine/compile_policy.py) | true | false
    compile: str = "auto"
    # FP8 or MX compute in the blocks' linears through torchao (keel/parallel/float8.py; keel[fp8]): off |
    # tensorwise | rowwise | rowwise_gw_hp | mxfp8 | mxfp4. Master weights and optimizer state are unchanged; the
    # embedding, head, norms, router and routed experts stay in high precision
    fp8: str = "off"
    fp8_skip_blocks: int = 0  # the first and the last this many blocks stay in high precision
    # a Hugging Face LlamaForCausalLM directory (safetensors) to start from instead of random init: continued
    # pretraining (keel/model/hf_init.py); its config must match model.* ("" = random init)
    init_from: str = ""
    # -- Mixture of experts (keel/model/moe.py, keel/model/router.py): every moe_* field, and only these, shape
    # the MoE blocks; moe_experts = 0 keeps every block dense and the rest unread. Expert parallelism is
    # parallel.ep. They stay flat `model.moe_*` keys (not a nested section) so every run dir's config.yaml stays
    # readable and resumable as written.
    moe_experts: int = 0
    # block i is MoE when (i + 1) % moe_every == 0: 1 = all blocks, 2 = every second
    moe_every: int = 1
    moe_top_k: int = 2
    moe_ffn_hidden: int = 0  # each expert's SwiGLU width; 0: the dense ffn width
    moe_scoring: str = "softmax"  # softmax | sigmoid
    # multiplicative input noise U(1-ε, 1+ε) on the router input while training
    moe_jitter: float = 0.0
    # a dense SwiGLU every token passes through, added to the routed output
    moe_shared_expert: bool = False
    moe_aux_loss: float = 0.01  # Switch/GShard load-balancing loss weight
    moe_z_loss: float = 0.001  # router z-loss weight (ST-MoE)
    # tokens per expert = ceil(factor · tokens · k / experts); 0: dropless
    moe_capacity_factor: float = 0.0
    # over capacity, drop the lowest-probability or the latest tokens
    moe_drop_policy: str = "probability"
    # aux-loss-free balancing: per-expert bias step toward uniform load (0: off)
    moe_bias_update: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        hidden = int(8 * self.dim / 3)
        m = self.ffn_multiple_of
        return m * ((hidden + m - 1) // m)


@dataclass
class DataConfig:
    # "default" = this Python's stdlib source; or weighted sources [{path: GLOB, weight: 0.7}, ...] (a blend)
    corpus: list[str | dict] = field(default_factory=lambda: ["default"])
    # global sample ranges "start:end" the sampler jumps over
    skip_ranges: list[str] = field(default_factory=list)
    text_field: str = "text"  # for .jsonl inputs
    # train: a sentencepiece BPE trained on the corpus | PATH: a sentencepiece .model, an HF tokenizer.json, or an
    # HF tokenizer / model directory (relative paths: from the config file's directory)
    tokenizer: str = "train"
    tokenizer_vocab_size: int = 4096  # only when training one
    seq_len: int = 128
    val_fraction: float = 0.01
    cache_dir: str = "~/.cache/keel"
    # attention stops at EOS and RoPE positions restart per document (packed windows)
    document_mask: bool = False
    # resume on another corpus, blend weights, seq_len, val_fraction or train.seed (refused unless true: the
    # checkpoint's sample count would index a different order)
    allow_change_on_resume: bool = False


@dataclass
class TrainConfig:
    steps: int = 300
    seed: int = 1234
    exit_after: int = 0  # >0: stop cleanly with a checkpoint after this many steps in this process
    global_batch_size: int = 16
    micro_batch_size: int = 4
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    # cosine | linear | constant | inverse_sqrt | wsd (warmup-stable-decay)
    lr_schedule: str = "cosine"
    decay_fraction: float = 0.2  # wsd: the final fraction of steps that decays to min_lr_ratio
    # batch-size ramp-up: start from this global batch (0: no ramp-up) ...
    rampup_start_batch: int = 0
    rampup_steps: int = 0  # ... and reach train.global_batch_size linearly over this many steps
    rampup_lr_scaling: str = "sqrt"  # LR follows the batch during ramp-up: linear | sqrt | none
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables
    ds_config: str = "ds_configs/zero1.json"
    eval_interval: int = 100  # 0 disables validation
    eval_batches: int = 4
    # recompute activations every N layers in backward (0: off)
    activation_checkpoint_interval: int = 0
    label_smoothing: float = 0.0
    z_loss: float = 0.0  # PaLM's auxiliary z_loss · logsumexp² per token


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: int = 1
    # context parallel: ring attention over cp ranks, each holding 2 of the sequence's 2·cp chunks
    cp: int = 1
    # Megatron sequence parallel over the tp group (needs tp > 1 to matter)
    sequence_parallel: bool = False
    # parameters | uniform | type:Block (DeepSpeed's partition methods)
    pipeline_partition: str = "parameters"
    pipeline_schedule: str = "1f1b"  # 1f1b | dualpipev | interleaved (PIPELINE_SCHEDULES)
    virtual_stages: int = 2  # interleaved: stages (chunks) per pipeline rank, Megatron's v

    def stages_per_rank(self) -> int:
        """How many pipeline stages each pipeline rank runs under `pipeline_schedule`."""
        return {"dualpipev": 2, "interleaved": self.virtual_stages}.get(self.pipeline_schedule, 1)


@dataclass
class CheckpointConfig:
    interval: int = 100  # 0: only at the end
    keep_last: int = 3
    # write in the background: a host snapshot now, the files while training continues (async_checkpoint.py)
    async_save: bool = False
    resume: bool = True  # resume from the latest complete checkpoint in the run dir
    # a save that fails (disk full, I/O error) is discarded on every rank; then: continue (warn, retry at the next
    # interval) | stop (exit 8). A failed final save exits 8 either way.
    on_save_error: str = "continue"
    # every N steps each rank's state into host memory that outlives the process (memory_dir, a tmpfs) and a copy
    # on a buddy rank on the next node; a restart restores from there when newer than disk (checkpoint/memory.py)
    memory_interval: int = 0
    memory_dir: str = "/dev/shm"


@dataclass
class LoggingConfig:
    log_interval: int = 10  # stdout line every N steps; metrics.jsonl gets every step
    # record every Keel collective per rank in RUN_DIR/collectives/ (debug, tests)
    collective_trace: bool = False
    # "warn": count the synchronizing CUDA calls of each step (keel/training/observe/sync_debug.py)
    sync_debug: str = ""
    # one device's peak, for the step line's MFU (0: H100/H200/A100 by name, else n/a)
    peak_tflops: float = 0.0


@dataclass
class StabilityConfig:
    """Guards that keep a run going through bad batches and numerics, or stop it with a diagnosis."""

    spike: bool = True
    # window: mean + k·σ over the last `spike_window` steps | ema: multiplicative EMA
    spike_mode: str = "window"
    spike_window: int = 128
    spike_sigmas: float = 6.0
    spike_warmup: int = 64  # steps of history before the spike guard acts
    spike_ema_beta: float = 0.99
    spike_ema_factor: float = 3.0  # ema mode: a spike is a value above factor × its EMA
    rollback_spikes: int = 3  # this many spikes ...
    rollback_window: int = 50  # ... within this many steps trigger a rollback
    rollback_lr_factor: float = 0.5
    max_nonfinite: int = 5  # consecutive non-finite steps before the run stops with the diagnosis
    # replay a non-finite batch with hooks to name the first bad module
    localize_nonfinite: bool = True
    loss_scale_halvings: int = 4  # fp16: warn when the scale halves this many times ...
    loss_scale_window: int = 100  # ... within this many steps
    loss_check_interval: int = 50  # cross-rank loss check every N steps (0: off)
    loss_check_sigmas: float = 3.0
    loss_check_repeats: int = 2  # flag a rank after this many consecutive outlier checks
    checksum_interval: int = 100  # parameter checksum comparison every N steps (0: off)
    # stop (exit code 3) | restore (reload the last checkpoint) | warn
    checksum_action: str = "stop"
    # seconds a step may take before stacks are dumped and the rank exits (0: off)
    watchdog_timeout: float = 600.0
    # the phases between steps, each with its own deadline (0: that phase unwatched); keep them below the process
    # group's timeout (30 min), or a dead peer is reported by the collective's timeout instead
    # periodic checks: checksums, loss-outlier gathers, monitor
    watchdog_check_timeout: float = 600.0
    watchdog_eval_timeout: float = 900.0  # validation
    watchdog_save_timeout: float = 1200.0  # checkpoint save, and the load of a rollback
    straggler_interval: int = 50  # log slowest/fastest rank step time every N steps (0: off)
    # a node whose rank is the slowest at this many consecutive straggler checks, each time this much slower than
    # the fastest rank (0.5: 50%), is recorded in bad_nodes.json for the next attempt to leave out (0: never)
    straggler_bad_repeats: int = 3
    straggler_bad_spread: float = 0.5
    # per-layer grad norms and activation statistics every N steps (0: off)
    monitor_interval: int = 50
    # the monitor's largest attention logit per block (keel/training/observe/attention_logits.py): warn above this
    # (0: off)
    attn_logit_warn: float = 1e4
    attn_logit_growth: float = 0.0  # ... or above this factor × its first recorded value (0: off)
    # model.fp8: the monitor's per-block fraction of an operand's non-zero values its FP8 casts put below the
    # format's normal range (or zero), and the fraction they clip (keel/training/observe/fp8_health.py): warn
    # above these (0: off)
    fp8_underflow_warn: float = 0.05
    fp8_saturation_warn: float = 0.001
    # MoE: per-layer expert load, dropped fraction, router entropy every N steps (0: off)
    expert_interval: int = 10
    # an expert under this fraction of the uniform share 1/E is starving ...
    expert_collapse_share: float = 0.1
    # ... for this many consecutive checks: the expert-collapse warning
    expert_collapse_checks: int = 3
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "keel"
    wandb_mode: str = "offline"  # offline works with no network


@dataclass
class FaultsConfig:
    """Fault injection for tests and for rehearsing recovery; every value 0/-1 means off."""

    nan_step: int = 0
    # MoE: the router never chooses this expert (an imbalanced router, for the warning)
    starve_expert: int = -1
    nan_rank: int = 0
    spike_step: int = 0  # one step, or...
    spike_steps: list[int] = field(default_factory=list)  # ...several steps whose loss is scaled
    spike_factor: float = 1000.0
    bitflip_step: int = 0
    bitflip_rank: int = 0
    # parameter name; empty: the first parameter whose state this rank holds
    bitflip_param: str = ""
    sleep_step: int = 0
    sleep_rank: int = 0
    sleep_s: float = 0.0
    noise_rank: int = -1  # this rank's data replaced by uniform random tokens
    # this rank sleeps save_stall_s inside every checkpoint save (a peer dead mid-save)
    save_stall_rank: int = -1
    save_stall_s: float = 0.0
    # this rank's disk fills inside DeepSpeed's shard write: ENOSPC after ...
    save_enospc_rank: int = -1
    save_enospc_bytes: int = 4096  # ... this many bytes of its first file ...
    save_enospc_step: int = 0  # ... in the save at this step (0: every save)
    # this rank reads checkpoint_dir instead of <run_dir>/checkpoints (a stale view)
    checkpoint_dir_rank: int = -1
    checkpoint_dir: str = ""
    save_stall_step: int = 0  # save_stall_rank stalls only in the save at this step (0: every save)
    # every rank exits at once (code 1, no cleanup) after this step: the job lost mid-run
    crash_step: int = 0
    # from this step on, the attention input of block outlier_block (after its norm) carries one channel ×
    # outlier_factor: an outlier feature that stretches an FP8 scale (the FP8 health warning names the block)
    outlier_step: int = 0
    outlier_block: int = 0
    outlier_factor: float = 1e4
    # every rank waits before this step until pause_file exists (rank 0 first writes <pause_file>.reached): an
    # operator's action at a known point of the run (a remount, a deleted directory, a kill)
    pause_step: int = 0
    pause_file: str = ""
    # `keel preflight` (keel/tools/preflight/): each check proven by a fault it must name
    # this rank's check matmul comes out wrong in one element (silent corruption)
    preflight_bad_matmul_rank: int = -1
    # ...or every rank on this node (SLURM's node name, else the host name): a fault that stays with its node when
    # the job is requeued elsewhere on fewer ranks
    preflight_bad_matmul_node: str = ""
    # ...by this relative error (below ~1e-5 only the majority vote sees it)
    preflight_bad_matmul_error: float = 0.01
    # this rank computes 8x slower and arrives late at every timed collective
    preflight_slow_rank: int = -1
    # every transfer through this rank carries 16x the bytes (a slow link)
    preflight_slow_link_rank: int = -1
    preflight_clock_skew_rank: int = -1  # this rank's clock runs preflight_clock_skew_s ahead
    preflight_clock_skew_s: float = 0.0
    # >= 0: every rank sees this much free space in the checkpoint directory
    preflight_free_bytes: int = -1
    # corrupt training state: after this step, once, NaN fills this rank's share of one tensor of the first
    # parameter it holds: exp_avg_sq (Adam's second moment), master (its fp32 master copy), param (its working copy)
    corrupt_state_step: int = 0
    corrupt_state_rank: int = 0
    corrupt_state_what: str = "exp_avg_sq"  # exp_avg_sq | master | param


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)}
_HINTS = {
    name: typing.get_type_hints(cls) for name, cls in typing.get_type_hints(RunConfig).items()
}


def _build_section(section: str, cls: type, values: Any) -> Any:
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{section}: expected a mapping of keys, got {values!r}")
    hints = _HINTS[section]
    values = _unalias(section, values)
    for key in values:
        if key not in hints:
            raise ConfigError(
                f"{section}.{key}: unknown key; valid keys are {', '.join(sorted(hints))}"
            )
    kwargs = {k: coerce(f"{section}.{k}", hints[k], v) for k, v in values.items()}
    return cls(**kwargs)


# another spelling of a key: `checkpoint.async` (as issue 15 and DeepSpeed users write it) is a Python keyword, so
# the field is named async_save
KEY_ALIASES = {("checkpoint", "async"): "async_save"}


def _unalias(section: str, values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in values.items():
        name = KEY_ALIASES.get((section, key), key)
        if name in out:
            raise ConfigError(
                f"{section}.{name}: given twice, as {section}.{given[name]} and {section}.{key}; "
                "keep one"
            )
        out[name], given[name] = value, key
    return out


def build_config(raw: dict[str, Any] | None) -> RunConfig:
    """A RunConfig from a parsed YAML mapping; unknown sections/keys and mistyped values are ConfigErrors."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            "config: the YAML file must be a mapping of sections (model, data, train, ...)"
        )
    hints = typing.get_type_hints(RunConfig)
    for section in raw:
        if section not in SECTIONS:
            raise ConfigError(
                f"{section}: unknown section; valid sections are {', '.join(SECTIONS)}"
            )
    return RunConfig(
        **{name: _build_section(name, hints[name], raw.get(name)) for name in SECTIONS}
    )


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings; values are parsed as YAML and typed later by the dataclass, except
    that a text field takes the text as typed (`--set data.text_field=yes` is "yes", not true)."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in (raw or {}).items()}
    for item in overrides:
        path, equals, text = item.partition("=")
        section, dot, key = path.partition(".")
        if not equals or not dot or not section or not key or "." in key:
            raise ConfigError(f"--set {item}: expected section.key=value (e.g. train.steps=100)")
        if raw.get(section) is None:
            raw[section] = {}
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{section}: expected a mapping of keys, got {raw[section]!r}")
        key = KEY_ALIASES.get((section, key), key)
        raw[section][key] = _override_value(
            f"{section}.{key}", _HINTS.get(section, {}).get(key), text
        )
    return raw


def _override_value(name: str, hint: Any, text: str) -> Any:
    if text == "":
        return ""
    try:
        value = parse_yaml(text)
    except yaml.YAMLError as exc:
        if hint is str:
            return text
        raise ConfigError(f"{name}: {text!r} is not a YAML value ({yaml_problem(exc)})") from None
    return text if hint is str and not isinstance(value, str) else value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read `path` (None: all defaults), apply `section.key=value` overrides, build the dataclasses; not validated."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config: file {path} does not exist")
        try:
            raw = parse_yaml(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"config: {path} is not valid YAML ({str(exc).splitlines()[0]})"
            ) from None
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(
                f"config: {path} must be a mapping of sections (model, data, train, ...)"
            )
    return build_config(apply_overrides(raw, list(overrides)))
