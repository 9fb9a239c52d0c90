"""Every rule a run configuration must satisfy, each stated once, checked before any rank starts.

A mistake found here costs seconds rather than a queued job, and every error is one `ConfigError` line naming
the field and what to change. Rules live with the config they validate, not with the code that uses the values:
that keeps the config importable by every module without an import cycle, and gives each rule one home. Code that
can be reached with values that skipped `validate` (a world size read from the environment, a hand-built
dataclass) calls the rule function here rather than restating it.
"""

from __future__ import annotations

from keel.config.corpus_spec import weighted_sources
from keel.config.schema import (
    CORRUPT_STATE_TARGETS,
    INITS,
    KERNELS,
    LR_SCHEDULES,
    MOE_DROP_POLICIES,
    MOE_SCORINGS,
    NORM_PLACEMENTS,
    NORMS,
    PARALLEL_AXES,
    PIPELINE_PARTITIONS,
    RAMPUP_SCALINGS,
    SAVE_ERROR_POLICIES,
    ConfigError,
    ModelConfig,
    RunConfig,
    StabilityConfig,
    TrainConfig,
)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _either(names: tuple[str, ...]) -> str:
    """("a", "b", "c") → "a, b or c", as the messages list the choices."""
    return f"{', '.join(names[:-1])} or {names[-1]}"


# -- the whole run ---------------------------------------------------------------------------------------------
def clamp_warmup(t: TrainConfig) -> str | None:
    """A warmup longer than the run (the default 30 steps in a quick `--set train.steps=20`) ends with the run:
    clamped, with the warning line to show (None when nothing changed). A negative one is still refused."""
    if t.warmup_steps <= t.steps or t.steps <= 0:
        return None
    line = (f"train.warmup_steps={t.warmup_steps} is longer than the run (train.steps={t.steps}): "
            f"clamped to {t.steps}")
    t.warmup_steps = t.steps
    return line


def validate(cfg: RunConfig, world_size: int) -> None:
    """Everything that can be checked without data or DeepSpeed; the DeepSpeed JSON is checked against it later."""
    validate_model(cfg.model)
    d, t, p, c = cfg.data, cfg.train, cfg.parallel, cfg.checkpoint
    _require(d.seq_len > 0, f"data.seq_len: must be positive, got {d.seq_len}")
    _require(0.0 < d.val_fraction < 0.5, f"data.val_fraction: expected a fraction in (0, 0.5), got {d.val_fraction}")
    _require(d.tokenizer.strip() != "", "data.tokenizer: empty; use train, or the path of a sentencepiece .model, "
             "an HF tokenizer.json or an HF tokenizer directory")
    _require(d.tokenizer != "train" or d.tokenizer_vocab_size >= 300,
             f"data.tokenizer_vocab_size: {d.tokenizer_vocab_size} is too small (byte fallback needs >= 300)")
    weighted_sources(d.corpus)
    _require(not d.document_mask or (p.pp == 1 and p.sp == 1),
             f"data.document_mask with parallel.pp={p.pp}, sp={p.sp}: the mask is built from the tokens in the "
             "model's forward, which pipeline stages and Ulysses shards do not see whole; use pp=1 and sp=1")
    _require(t.steps > 0, f"train.steps: must be positive, got {t.steps}")
    _require(t.exit_after >= 0, f"train.exit_after: must be >= 0 (0 disables), got {t.exit_after}")
    _require(t.micro_batch_size > 0, f"train.micro_batch_size: must be positive, got {t.micro_batch_size}")
    _require(t.global_batch_size > 0, f"train.global_batch_size: must be positive, got {t.global_batch_size}")
    _require(t.lr > 0, f"train.lr: must be positive, got {t.lr}")
    _require(0.0 <= t.label_smoothing < 1.0 and t.z_loss >= 0,
             "train.label_smoothing must lie in [0, 1) and train.z_loss be >= 0")
    _require(0.0 <= t.min_lr_ratio <= 1.0, f"train.min_lr_ratio: expected a ratio in [0, 1], got {t.min_lr_ratio}")
    _require(0 <= t.warmup_steps <= t.steps,
             f"train.warmup_steps: {t.warmup_steps} must lie in [0, train.steps={t.steps}]")
    _require(all(0.0 <= b < 1.0 for b in t.betas), f"train.betas: each must lie in [0, 1), got {list(t.betas)}")
    _require(t.eps > 0 and t.weight_decay >= 0 and t.grad_clip >= 0,
             "train.eps must be positive; train.weight_decay and train.grad_clip must be >= 0")
    _require(t.eval_interval >= 0 and t.eval_batches > 0,
             "train.eval_interval must be >= 0 (0 disables) and train.eval_batches positive")
    _require(c.interval >= 0, f"checkpoint.interval: must be >= 0 (0: only at the end), got {c.interval}")
    _require(c.keep_last >= 1, f"checkpoint.keep_last: must keep at least 1, got {c.keep_last}")
    _require(c.on_save_error in SAVE_ERROR_POLICIES,
             f"checkpoint.on_save_error: expected {_either(SAVE_ERROR_POLICIES)}, got {c.on_save_error!r}")
    _require(cfg.faults.save_enospc_bytes >= 0 and cfg.faults.save_enospc_step >= 0,
             "faults.save_enospc_bytes and faults.save_enospc_step must be >= 0")
    _require(cfg.faults.corrupt_state_what in CORRUPT_STATE_TARGETS, "faults.corrupt_state_what: expected "
             f"{_either(CORRUPT_STATE_TARGETS)}, got {cfg.faults.corrupt_state_what!r}")
    _require(cfg.logging.sync_debug in ("", "warn"),
             f"logging.sync_debug: expected '' (off) or 'warn', got {cfg.logging.sync_debug!r}")
    _require(cfg.logging.peak_tflops >= 0,
             f"logging.peak_tflops: must be >= 0 (0: by device name), got {cfg.logging.peak_tflops}")
    for name in PARALLEL_AXES:
        size = getattr(p, name)
        _require(size >= 1, f"parallel.{name}: must be >= 1, got {size}")
    validate_layout(cfg)
    _require(t.activation_checkpoint_interval >= 0,
             f"train.activation_checkpoint_interval: must be >= 0 (0 disables), got {t.activation_checkpoint_interval}")
    _require(p.pipeline_partition in PIPELINE_PARTITIONS or p.pipeline_partition.startswith("type:"),
             f"parallel.pipeline_partition: expected {', '.join(PIPELINE_PARTITIONS)} or type:<LayerClass>, "
             f"got {p.pipeline_partition!r}")
    _require(p.pp <= cfg.model.n_layers + 3,
             f"parallel.pp={p.pp}: more pipeline stages than the {cfg.model.n_layers + 3} layers to split")
    dp = validate_world_size(world_size, tp=p.tp, pp=p.pp, sp=p.sp, ep=p.ep)
    validate_batch_split(t, dp)
    validate_schedule(t, dp)
    validate_watchdog(cfg.stability)


def validate_watchdog(s: StabilityConfig) -> None:
    """Each watched phase's deadline is a number of seconds, 0 meaning unwatched."""
    for name in ("watchdog_timeout", "watchdog_check_timeout", "watchdog_eval_timeout", "watchdog_save_timeout"):
        value = getattr(s, name)
        _require(value >= 0, f"stability.{name}: must be >= 0 seconds (0: off), got {value}")
    _require(s.attn_logit_warn >= 0, f"stability.attn_logit_warn: must be >= 0 (0: off), got {s.attn_logit_warn}")
    _require(s.attn_logit_growth == 0 or s.attn_logit_growth > 1,
             f"stability.attn_logit_growth: a factor > 1 (0: off), got {s.attn_logit_growth}")


# -- the model -------------------------------------------------------------------------------------------------
def validate_model(m: ModelConfig) -> None:
    """Shapes and choices of the model alone; also called by `build_layers` for models built without `validate`."""
    _require(m.vocab_size >= 0, f"model.vocab_size: must be >= 0 (0 takes the tokenizer's), got {m.vocab_size}")
    for role in ("bos_id", "eos_id", "pad_id"):
        value = getattr(m, role)
        _require(value >= -1, f"model.{role}: must be >= -1 (-1: the tokenizer's), got {value}")
    _require(m.dim > 0 and m.n_layers > 0, "model.dim and model.n_layers must be positive")
    _require(m.n_heads > 0 and m.dim % m.n_heads == 0, f"model.n_heads: {m.n_heads} does not divide model.dim {m.dim}")
    _require(m.n_kv_heads > 0 and m.n_heads % m.n_kv_heads == 0,
             f"model.n_kv_heads: {m.n_kv_heads} must divide model.n_heads {m.n_heads}")
    _require(m.head_dim % 2 == 0, f"model.dim: head_dim = dim / n_heads = {m.head_dim} must be even for RoPE")
    _require(m.norm in NORMS, f"model.norm: expected {_either(NORMS)}, got {m.norm!r}")
    _require(m.init in INITS, f"model.init: expected {_either(INITS)}, got {m.init!r}")
    _require(m.kernels in KERNELS, f"model.kernels: expected {_either(KERNELS)}, got {m.kernels!r}")
    _require(0.0 <= m.dropout < 1.0, f"model.dropout: expected a probability in [0, 1), got {m.dropout}")
    _require(m.vocab_pad_multiple >= 1, f"model.vocab_pad_multiple: must be >= 1, got {m.vocab_pad_multiple}")
    _require(m.init_std > 0, f"model.init_std: must be positive, got {m.init_std}")
    _require(m.embedding_init_std >= 0,
             f"model.embedding_init_std: must be >= 0 (0: the matrices' std), got {m.embedding_init_std}")
    _require(m.norm_placement in NORM_PLACEMENTS,
             f"model.norm_placement: expected {_either(NORM_PLACEMENTS)}, got {m.norm_placement!r}")
    _require(not m.deepnorm or m.norm_placement == "post",
             f"model.deepnorm: DeepNet is post-norm; set model.norm_placement: post (got {m.norm_placement!r})")
    _require(m.norm_eps > 0 and m.rope_theta > 0, "model.norm_eps and model.rope_theta must be positive")
    validate_moe(m)


def validate_moe(m: ModelConfig) -> None:
    """The mixture-of-experts settings (nothing to check for a dense model)."""
    if m.moe_experts == 0:
        return
    _require(m.moe_experts >= 2, f"model.moe_experts: an MoE layer needs >= 2 experts, got {m.moe_experts}")
    _require(1 <= m.moe_top_k <= min(2, m.moe_experts), f"model.moe_top_k: expected 1 or 2, got {m.moe_top_k}")
    _require(1 <= m.moe_every <= m.n_layers, f"model.moe_every: expected 1..n_layers={m.n_layers}, got {m.moe_every}")
    _require(m.moe_ffn_hidden >= 0,
             f"model.moe_ffn_hidden: must be >= 0 (0: the dense width), got {m.moe_ffn_hidden}")
    _require(m.moe_scoring in MOE_SCORINGS, f"model.moe_scoring: expected {_either(MOE_SCORINGS)}, got "
                                            f"{m.moe_scoring!r}")
    _require(0.0 <= m.moe_jitter < 1.0, f"model.moe_jitter: expected a fraction in [0, 1), got {m.moe_jitter}")
    _require(m.moe_aux_loss >= 0 and m.moe_z_loss >= 0, "model.moe_aux_loss and model.moe_z_loss must be >= 0")
    _require(m.moe_capacity_factor >= 0,
             f"model.moe_capacity_factor: must be >= 0 (0: dropless), got {m.moe_capacity_factor}")
    _require(m.moe_drop_policy in MOE_DROP_POLICIES,
             f"model.moe_drop_policy: expected {_either(MOE_DROP_POLICIES)}, got {m.moe_drop_policy!r}")
    _require(m.moe_bias_update >= 0, f"model.moe_bias_update: must be >= 0 (0: off), got {m.moe_bias_update}")


# -- the LR schedule and batch-size ramp-up --------------------------------------------------------------------
def validate_schedule(t: TrainConfig, dp: int) -> None:
    """Schedule and ramp-up fields for `dp` data-parallel ranks."""
    validate_schedule_choices(t)
    _require(0.0 < t.decay_fraction <= 1.0,
             f"train.decay_fraction: expected a fraction in (0, 1], got {t.decay_fraction}")
    _require(t.rampup_start_batch >= 0, f"train.rampup_start_batch: must be >= 0 (0: no ramp-up), got "
             f"{t.rampup_start_batch}")
    _require(t.rampup_steps >= 0, f"train.rampup_steps: must be >= 0, got {t.rampup_steps}")
    if t.rampup_start_batch == 0:  # no ramp-up
        return
    unit = t.micro_batch_size * dp
    _require(t.rampup_start_batch < t.global_batch_size,
             f"train.rampup_start_batch={t.rampup_start_batch} must be smaller than "
             f"train.global_batch_size={t.global_batch_size}")
    _require(t.rampup_start_batch % unit == 0,
             f"train.rampup_start_batch={t.rampup_start_batch} must be a multiple of train.micro_batch_size×dp = "
             f"{t.micro_batch_size}×{dp} = {unit}")
    _require(t.rampup_steps >= 1,
             f"train.rampup_steps: must be >= 1 when train.rampup_start_batch > 0, got {t.rampup_steps}")


def validate_schedule_choices(t: TrainConfig) -> None:
    """The schedule and ramp-up LR scaling name shapes `keel.training.lr_schedule` has; called by its dispatch
    when it meets an unknown name (a TrainConfig built by hand), so the error is this one."""
    _require(t.lr_schedule in LR_SCHEDULES, f"train.lr_schedule: expected {_either(LR_SCHEDULES)}, "
                                            f"got {t.lr_schedule!r}")
    _require(t.rampup_lr_scaling in RAMPUP_SCALINGS,
             f"train.rampup_lr_scaling: expected one of {', '.join(RAMPUP_SCALINGS)}, got {t.rampup_lr_scaling!r}")


def validate_batch_split(t: TrainConfig, dp: int) -> None:
    """The global batch splits into whole micro-batches on each of `dp` ranks. Also called where DeepSpeed's
    gradient accumulation is derived from the data-parallel size the ranks actually have (a resize on resume)."""
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"train.global_batch_size={t.global_batch_size} must be a multiple of train.micro_batch_size×dp = "
             f"{t.micro_batch_size}×{dp} = {t.micro_batch_size * dp}")


# -- the parallel layout ---------------------------------------------------------------------------------------
def validate_world_size(world_size: int, tp: int = 1, pp: int = 1, sp: int = 1, ep: int = 1) -> int:
    """The world factors into tp×pp×sp model-parallel ranks times a data-parallel size that ep divides; returns
    that data-parallel size. Also called by `keel.parallel.topology.GridShape`, whose world size comes from the
    process group (an external launcher, a resumed job on fewer nodes, a test or benchmark) and may never have
    passed through `validate`."""
    _require(world_size >= 1, f"world size must be >= 1, got {world_size}")
    model_parallel = tp * pp * sp
    dp = world_size // model_parallel
    _require(world_size % model_parallel == 0,
             f"parallel: world size {world_size} is not divisible by tp×pp×sp = {model_parallel}")
    _require(dp % ep == 0, f"parallel.ep={ep} must divide the data-parallel size {dp} "
                           f"(world size {world_size} / tp×pp×sp {model_parallel})")
    return dp


def validate_layout(cfg: RunConfig) -> None:
    """Heads, kv heads, widths, experts and the sequence must split evenly over the parallel sizes."""
    validate_tensor_parallel(cfg)
    validate_expert_and_sequence_parallel(cfg)
    validate_compile(cfg)


COMPILE_SETTINGS = {"auto": "auto", "true": "true", "false": "false", "on": "true", "off": "false",
                    "yes": "true", "no": "false", "1": "true", "0": "false"}


def compile_setting(value: object) -> str:
    """`model.compile` as one of auto/true/false (YAML gives booleans, the CLI strings)."""
    key = str(value).lower()
    _require(key in COMPILE_SETTINGS, f"model.compile: expected auto, true or false, got {value!r}")
    return COMPILE_SETTINGS[key]


def unsupported_compile_layout(cfg: RunConfig) -> list[str]:
    """The settings a compiled block is not proven under: the blocks' collectives (tp, sp, ep all-to-all) and
    the pipeline engine's layer calls."""
    m, p = cfg.model, cfg.parallel
    return [name for name, on in (("model.moe_experts", m.moe_experts > 0), ("parallel.tp", p.tp > 1),
                                  ("parallel.pp", p.pp > 1), ("parallel.sp", p.sp > 1)) if on]


def validate_compile(cfg: RunConfig) -> None:
    """model.compile=true is proven (equal losses, tests) on dense blocks without model parallelism: refuse it
    elsewhere. `auto` just stays eager there (keel/training/compile_policy.py)."""
    if compile_setting(cfg.model.compile) != "true":
        return
    unsupported = unsupported_compile_layout(cfg)
    _require(not unsupported, f"model.compile: supported for dense models with parallel.tp = pp = sp = 1 "
                              f"(data parallel, ZeRO 0-2); set model.compile=false or drop {', '.join(unsupported)}")


def validate_tensor_parallel(cfg: RunConfig) -> None:
    """Heads, kv heads and the MLP width must split evenly over tp; SP shards the sequence over tp."""
    m, tp = cfg.model, cfg.parallel.tp
    if tp == 1:
        return
    _require(m.n_heads % tp == 0, f"model.n_heads={m.n_heads} must be divisible by parallel.tp={tp}")
    _require(m.n_kv_heads % tp == 0 or tp % m.n_kv_heads == 0,
             f"model.n_kv_heads={m.n_kv_heads} and parallel.tp={tp}: one must divide the other "
             "(kv heads are split when tp divides them, replicated when they divide tp)")
    _require(m.ffn_dim % tp == 0, f"model.ffn_hidden: the MLP width {m.ffn_dim} must be divisible by parallel.tp={tp}")
    expert_width = m.moe_ffn_hidden or m.ffn_dim
    _require(not m.moe_experts or expert_width % tp == 0,
             f"model.moe_ffn_hidden: the expert width {expert_width} must be divisible by parallel.tp={tp}")
    if cfg.parallel.sequence_parallel:
        _require(cfg.data.seq_len % tp == 0,
                 f"data.seq_len={cfg.data.seq_len} must be divisible by parallel.tp={tp} under sequence parallel")


def validate_expert_and_sequence_parallel(cfg: RunConfig) -> None:
    """ep shards the experts (so needs them, evenly); Ulysses sp shards the sequence and, in attention, the heads."""
    m, p = cfg.model, cfg.parallel
    if p.ep > 1:
        _require(m.moe_experts > 0, f"parallel.ep={p.ep} needs a mixture-of-experts model: set model.moe_experts")
        _require(m.moe_experts % p.ep == 0,
                 f"model.moe_experts={m.moe_experts} must be divisible by parallel.ep={p.ep}")
    if p.sp == 1:
        return
    heads = m.n_heads // p.tp
    _require(heads % p.sp == 0, f"parallel.sp={p.sp} must divide the attention heads per tensor-parallel rank "
                                f"(model.n_heads / parallel.tp = {heads})")
    shards = p.sp * (p.tp if p.sequence_parallel else 1)
    _require(cfg.data.seq_len % shards == 0,
             f"data.seq_len={cfg.data.seq_len} must be divisible by {shards} (parallel.sp"
             f"{' × parallel.tp under sequence_parallel' if p.sequence_parallel else ''})")
