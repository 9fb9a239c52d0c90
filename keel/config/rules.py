"""Every rule a run configuration must satisfy, each stated once, checked before any rank starts.

A mistake found here costs seconds rather than a queued job, and every error is one `ConfigError` line naming
the field and what to change. Rules live with the config they validate, not with the code that uses the values:
that keeps the config importable by every module without an import cycle, and gives each rule one home. Code that
can be reached with values that skipped `validate` (a world size read from the environment, a hand-built
dataclass) calls the rule function here rather than restating it.
"""

from __future__ import annotations

from keel.config.bounds import BOUNDS
from keel.config.corpus_spec import weighted_sources
from keel.config.schema import (
    CHOICES,
    LR_SCHEDULES,
    PIPELINE_PARTITIONS,
    RAMPUP_SCALINGS,
    SECTIONS,
    ConfigError,
    FaultsConfig,
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


# -- each field on its own: its range (keel/config/bounds.py) or its names (schema.CHOICES) -----------------------
def _by_section(table: dict) -> dict[str, list[tuple[str, str, object]]]:
    return {
        section: [
            (name, name.split(".")[1], rule)
            for name, rule in table.items()
            if name.startswith(section + ".")
        ]
        for section in SECTIONS
    }


_BOUNDS_BY_SECTION, _CHOICES_BY_SECTION = _by_section(BOUNDS), _by_section(CHOICES)


def validate_fields(section: str, values: object, keys: tuple[str, ...] | None = None) -> None:
    """Every numeric field of `section` (or its `keys`) within its bound (each item of a list), every choice one of
    its names."""
    for name, key, bound in _BOUNDS_BY_SECTION[section]:
        if keys is not None and key not in keys:
            continue
        value = getattr(values, key)
        items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, item in items:
            label = name if i is None else f"{name}[{i}]"
            _require(
                isinstance(item, (int, float))
                and not isinstance(item, bool)
                and bound.admits(item),
                f"{label}: must be {bound.describe()}, got {item!r}",
            )
    for name, key, choices in _CHOICES_BY_SECTION[section]:
        if keys is not None and key not in keys:
            continue
        value = getattr(values, key)
        _require(
            value in choices,
            f"{name}: expected {_either(tuple(repr(c) if not c else c for c in choices))}, "
            f"got {value!r}",
        )


# -- the whole run ---------------------------------------------------------------------------------------------
def clamp_warmup(train: TrainConfig) -> str | None:
    """A warmup longer than the run (the default 30 steps in a quick `--set train.steps=20`) ends with the run:
    clamped, with the warning line to show (None when nothing changed). A negative one is still refused."""
    if train.warmup_steps <= train.steps or train.steps <= 0:
        return None
    line = (
        f"train.warmup_steps={train.warmup_steps} is longer than the run (train.steps={train.steps}): "
        f"clamped to {train.steps}"
    )
    train.warmup_steps = train.steps
    return line


def validate(cfg: RunConfig, world_size: int) -> None:
    """Everything that can be checked without data or DeepSpeed; the DeepSpeed JSON is checked against it later."""
    validate_model(cfg.model)
    for section in SECTIONS:
        if section != "model":
            validate_fields(section, getattr(cfg, section))
    data, train, parallel = cfg.data, cfg.train, cfg.parallel
    _require(
        data.tokenizer.strip() != "",
        "data.tokenizer: empty; use train, or the path of a sentencepiece .model, "
        "an HF tokenizer.json or an HF tokenizer directory",
    )
    _require(
        data.tokenizer != "train" or data.tokenizer_vocab_size >= 300,
        f"data.tokenizer_vocab_size: {data.tokenizer_vocab_size} is too small (byte fallback needs >= 300)",
    )
    weighted_sources(data.corpus)
    for i, item in enumerate(data.skip_ranges):
        parse_skip_range(item, f"data.skip_ranges[{i}]")
    _require(
        not data.document_mask or (parallel.pp == 1 and parallel.sp == 1),
        f"data.document_mask with parallel.pp={parallel.pp}, sp={parallel.sp}: the mask is built from the "
        "tokens in the model's forward, which pipeline stages and Ulysses shards do not see whole; use pp=1 "
        "and sp=1 (context parallel, parallel.cp, keeps document masking)",
    )
    _require(
        train.warmup_steps <= train.steps,
        f"train.warmup_steps: {train.warmup_steps} must lie in [0, train.steps={train.steps}]",
    )
    validate_layout(cfg)
    validate_mx_blocks(cfg)
    _require(
        parallel.pipeline_partition in PIPELINE_PARTITIONS
        or parallel.pipeline_partition.startswith("type:"),
        f"parallel.pipeline_partition: expected {', '.join(PIPELINE_PARTITIONS)} or type:<LayerClass>, "
        f"got {parallel.pipeline_partition!r}",
    )
    if parallel.pipeline_schedule != "1f1b":
        _require(
            parallel.pp > 1,
            f"parallel.pipeline_schedule={parallel.pipeline_schedule} needs parallel.pp >= 2 (got {parallel.pp})",
        )
        _require(
            not cfg.model.moe_experts,
            f"parallel.pipeline_schedule={parallel.pipeline_schedule} with model.moe_experts:"
            " MoE runs in pipeline stages under 1f1b only; use parallel.pipeline_schedule=1f1b",
        )
        stages = parallel.stages_per_rank() * parallel.pp
        _require(
            stages <= cfg.model.n_layers + 3,
            f"parallel.pp={parallel.pp}: {parallel.pipeline_schedule} cuts {parallel.stages_per_rank()}×pp = "
            f"{stages} stages, more "
            f"than the {cfg.model.n_layers + 3} layers to split"
            f"{'; lower parallel.virtual_stages' if parallel.pipeline_schedule == 'interleaved' else ''}",
        )
    _require(
        parallel.pp <= cfg.model.n_layers + 3,
        f"parallel.pp={parallel.pp}: more pipeline stages than the {cfg.model.n_layers + 3} layers to split",
    )
    dp = validate_world_size(
        world_size, tp=parallel.tp, pp=parallel.pp, sp=parallel.sp, ep=parallel.ep, cp=parallel.cp
    )
    validate_batch_split(train, dp)
    first_batch = min(train.rampup_start_batch or train.global_batch_size, train.global_batch_size)
    micro_batches = first_batch // (train.micro_batch_size * dp)
    validate_schedule_batches(cfg, micro_batches, first_batch, dp)
    validate_schedule(train, dp)
    validate_stability(cfg.stability)
    validate_faults(cfg.faults, world_size, cfg.model.moe_experts)


def validate_schedule_batches(
    cfg: RunConfig, micro_batches: int, first_batch: int, dp: int
) -> None:
    """The micro-batch counts a multi-stage pipeline schedule runs with: both schedules run on DeepSpeed's
    `DualPipeVEngine`, which asserts at least 2×pp per step; interleaved 1F1B takes them in groups of pp (for the
    validation batches too)."""
    parallel, train = cfg.parallel, cfg.train
    if parallel.pipeline_schedule == "1f1b":
        return
    fix = (
        f"raise train.global_batch_size{' and train.rampup_start_batch' if train.rampup_start_batch else ''} or "
        "lower train.micro_batch_size"
    )
    _require(
        micro_batches >= 2 * parallel.pp,
        f"parallel.pipeline_schedule={parallel.pipeline_schedule} needs at least 2×pp = {2 * parallel.pp} "
        "micro-batches per "
        f"step on each data-parallel rank; a batch of {first_batch} gives {micro_batches} (batch / "
        f"(train.micro_batch_size×dp = {train.micro_batch_size}×{dp})): {fix}",
    )
    if parallel.pipeline_schedule == "dualpipev":
        _require(
            train.eval_batches >= 2 * parallel.pp,
            f"train.eval_batches: {train.eval_batches} validation micro-batches; "
            f"parallel.pipeline_schedule=dualpipev needs at least 2×pp = {2 * parallel.pp}",
        )
        return
    _require(
        not train.rampup_start_batch,
        f"train.rampup_start_batch={train.rampup_start_batch} with parallel."
        "pipeline_schedule=interleaved: the ramp steps through every micro-batch count and interleaved 1F1B "
        f"takes them in groups of pp={parallel.pp}; ramp under 1f1b or dualpipev, or set "
        "train.rampup_start_batch=0",
    )
    _require(
        micro_batches % parallel.pp == 0,
        f"parallel.pipeline_schedule=interleaved takes micro-batches in groups of pp={parallel.pp}; a batch of "
        f"{first_batch} gives {micro_batches} per step: make it a multiple of {parallel.pp} "
        "(train.global_batch_size "
        f"= micro-batches × train.micro_batch_size × dp)",
    )
    _require(
        train.eval_batches % parallel.pp == 0,
        f"train.eval_batches: {train.eval_batches}; parallel.pipeline_schedule="
        f"interleaved takes micro-batches in groups of pp={parallel.pp}: use a multiple of {parallel.pp}",
    )


def validate_stability(stability: StabilityConfig) -> None:
    """A growth factor at or below 1 would flag every step."""
    _require(
        stability.attn_logit_growth == 0 or stability.attn_logit_growth > 1,
        f"stability.attn_logit_growth: a factor > 1 (0: off), got {stability.attn_logit_growth}",
    )


def parse_skip_range(item: object, name: str = "data.skip_ranges") -> tuple[int, int]:
    """A `data.skip_ranges` entry "start:end" (global sample indices, 0 <= start < end) as (start, end)."""
    parts = str(item).split(":") if isinstance(item, str) else []
    try:
        start, end = (int(x) for x in parts) if len(parts) == 2 else (-1, -1)
    except ValueError:
        start, end = -1, -1
    _require(0 <= start < end, f"{name}: expected 'start:end' with 0 <= start < end, got {item!r}")
    return start, end


def validate_faults(faults: FaultsConfig, world_size: int, experts: int) -> None:
    """A fault aimed at a rank or an expert that does not exist would silently never fire."""
    for key in (
        "nan_rank",
        "bitflip_rank",
        "sleep_rank",
        "noise_rank",
        "save_stall_rank",
        "checkpoint_dir_rank",
        "save_enospc_rank",
        "corrupt_state_rank",
        "preflight_bad_matmul_rank",
        "preflight_slow_rank",
        "preflight_slow_link_rank",
        "preflight_clock_skew_rank",
    ):
        rank = getattr(faults, key)
        _require(rank < world_size, f"faults.{key}={rank}: the run has ranks 0..{world_size - 1}")
    _require(
        not faults.pause_step or bool(faults.pause_file),
        f"faults.pause_step={faults.pause_step}: set faults.pause_file, the file whose creation ends the pause",
    )
    _require(
        faults.starve_expert < experts,
        f"faults.starve_expert={faults.starve_expert}: "
        + (
            f"the model has experts 0..{experts - 1}"
            if experts
            else "needs an MoE model (model.moe_experts)"
        ),
    )


# -- the model -------------------------------------------------------------------------------------------------
def validate_model(model: ModelConfig) -> None:
    """Shapes and choices of the model alone; also called by `build_layers` for models built without `validate`."""
    validate_fields("model", model)
    _require(
        model.dim % model.n_heads == 0,
        f"model.n_heads: {model.n_heads} does not divide model.dim {model.dim}",
    )
    _require(
        model.n_heads % model.n_kv_heads == 0,
        f"model.n_kv_heads: {model.n_kv_heads} must divide model.n_heads {model.n_heads}",
    )
    _require(
        model.head_dim % 2 == 0,
        f"model.dim: head_dim = dim / n_heads = {model.head_dim} must be even for RoPE",
    )
    _require(
        not model.deepnorm or model.norm_placement == "post",
        f"model.deepnorm: DeepNet is post-norm; set model.norm_placement: post (got {model.norm_placement!r})",
    )
    _require(
        model.fp8 == "off" or 2 * model.fp8_skip_blocks < model.n_layers,
        f"model.fp8_skip_blocks: keeping the first and last {model.fp8_skip_blocks} of {model.n_layers} blocks in "
        "high precision leaves none in FP8; lower it or set model.fp8=off",
    )
    validate_moe(model)


# elements per scale of the MX formats (keel/parallel/float8.py)
MX_BLOCK = 32


def validate_mx_blocks(cfg: RunConfig) -> None:
    """model.fp8=mxfp8/mxfp4 scale blocks of 32 along each GEMM's reduction axis: every per-rank extent a GEMM
    reduces over (its input features, output features and tokens) must hold whole blocks, so that no block is
    cut by a shard (which would also make the numerics depend on the layout)."""
    model, parallel, train = cfg.model, cfg.parallel, cfg.train
    if not model.fp8.startswith("mx"):
        return
    tp = parallel.tp
    kv_rows = model.n_kv_heads * model.head_dim
    extents = {
        "model.dim": model.dim,
        "the query width per tp rank (n_heads·head_dim / tp)": model.n_heads * model.head_dim // tp,
        "the feed-forward width per tp rank": model.ffn_dim // tp,
        "tokens per micro-batch per sp rank (micro_batch_size·seq_len / sp)": (
            train.micro_batch_size * cfg.data.seq_len // parallel.sp
        ),
    }
    if model.n_kv_heads % tp == 0:  # replicated kv heads stay in high precision
        extents["the k/v width per tp rank (n_kv_heads·head_dim / tp)"] = kv_rows // tp
    for what, extent in extents.items():
        _require(
            extent % MX_BLOCK == 0,
            f"model.fp8={model.fp8}: {what} is {extent}, not a multiple of the {MX_BLOCK}-element MX block; "
            "change the widths, the batch or the layout, or use an FP8 recipe (tensorwise, rowwise)",
        )


def validate_moe(model: ModelConfig) -> None:
    """The mixture-of-experts settings that relate to the model (each field's range is checked on its own)."""
    if model.moe_experts == 0:
        return
    _require(
        model.moe_experts >= 2,
        f"model.moe_experts: an MoE layer needs >= 2 experts, got {model.moe_experts}",
    )
    _require(
        model.moe_every <= model.n_layers,
        f"model.moe_every: expected 1..n_layers={model.n_layers}, got {model.moe_every}",
    )


# -- the LR schedule and batch-size ramp-up --------------------------------------------------------------------
def validate_schedule(train: TrainConfig, dp: int) -> None:
    """Schedule and ramp-up fields for `dp` data-parallel ranks."""
    validate_schedule_choices(train)
    validate_fields("train", train, ("decay_fraction", "rampup_start_batch", "rampup_steps"))
    if train.rampup_start_batch == 0:  # no ramp-up
        return
    unit = train.micro_batch_size * dp
    _require(
        train.rampup_start_batch < train.global_batch_size,
        f"train.rampup_start_batch={train.rampup_start_batch} must be smaller than "
        f"train.global_batch_size={train.global_batch_size}",
    )
    _require(
        train.rampup_start_batch % unit == 0,
        f"train.rampup_start_batch={train.rampup_start_batch} must be a multiple of train.micro_batch_size×dp = "
        f"{train.micro_batch_size}×{dp} = {unit}",
    )
    _require(
        train.rampup_steps >= 1,
        f"train.rampup_steps: must be >= 1 when train.rampup_start_batch > 0, got {train.rampup_steps}",
    )


def validate_schedule_choices(train: TrainConfig) -> None:
    """The schedule and ramp-up LR scaling name shapes `keel.engine.lr_schedule` has; called by its dispatch
    when it meets an unknown name (a TrainConfig built by hand), so the error is this one."""
    _require(
        train.lr_schedule in LR_SCHEDULES,
        f"train.lr_schedule: expected {_either(LR_SCHEDULES)}, got {train.lr_schedule!r}",
    )
    _require(
        train.rampup_lr_scaling in RAMPUP_SCALINGS,
        f"train.rampup_lr_scaling: expected one of {', '.join(RAMPUP_SCALINGS)}, got {train.rampup_lr_scaling!r}",
    )


def validate_batch_split(train: TrainConfig, dp: int) -> None:
    """The global batch splits into whole micro-batches on each of `dp` ranks. Also called where DeepSpeed's
    gradient accumulation is derived from the data-parallel size the ranks actually have (a resize on resume)."""
    _require(
        train.global_batch_size % (train.micro_batch_size * dp) == 0,
        f"train.global_batch_size={train.global_batch_size} must be a multiple of train.micro_batch_size×dp = "
        f"{train.micro_batch_size}×{dp} = {train.micro_batch_size * dp}",
    )


# -- the parallel layout ---------------------------------------------------------------------------------------
def validate_world_size(
    world_size: int, tp: int = 1, pp: int = 1, sp: int = 1, ep: int = 1, cp: int = 1
) -> int:
    """The world factors into tp×pp×cp×sp model-parallel ranks times a data-parallel size that ep divides; returns
    that data-parallel size. Also called by `keel.parallel.topology.GridShape`, whose world size comes from the
    process group (an external launcher, a resumed job on fewer nodes, a test or benchmark) and may never have
    passed through `validate`."""
    _require(world_size >= 1, f"world size must be >= 1, got {world_size}")
    model_parallel = tp * pp * cp * sp
    dp = world_size // model_parallel
    _require(
        world_size % model_parallel == 0,
        f"parallel: world size {world_size} is not divisible by tp×pp×cp×sp = {model_parallel}",
    )
    _require(
        dp % ep == 0,
        f"parallel.ep={ep} must divide the data-parallel size {dp} "
        f"(world size {world_size} / tp×pp×cp×sp {model_parallel})",
    )
    return dp


def validate_layout(cfg: RunConfig) -> None:
    """Heads, kv heads, widths, experts and the sequence must split evenly over the parallel sizes."""
    validate_tensor_parallel(cfg)
    validate_expert_and_sequence_parallel(cfg)
    validate_compile(cfg)


COMPILE_SETTINGS = {
    "auto": "auto",
    "true": "true",
    "false": "false",
    "on": "true",
    "off": "false",
    "yes": "true",
    "no": "false",
    "1": "true",
    "0": "false",
}


def compile_setting(value: object) -> str:
    """`model.compile` as one of auto/true/false (YAML gives booleans, the CLI strings)."""
    key = str(value).lower()
    _require(key in COMPILE_SETTINGS, f"model.compile: expected auto, true or false, got {value!r}")
    return COMPILE_SETTINGS[key]


def unsupported_compile_layout(cfg: RunConfig) -> list[str]:
    """The settings a compiled block is not proven under: the blocks' collectives (tp, sp, ep all-to-all) and
    the pipeline engine's layer calls."""
    model, parallel = cfg.model, cfg.parallel
    return [
        name
        for name, on in (
            ("model.moe_experts", model.moe_experts > 0),
            ("parallel.tp", parallel.tp > 1),
            ("parallel.pp", parallel.pp > 1),
            ("parallel.sp", parallel.sp > 1),
            ("parallel.cp", parallel.cp > 1),
        )
        if on
    ]


def validate_compile(cfg: RunConfig) -> None:
    """model.compile=true is proven (equal losses, tests) on dense blocks without model parallelism: refuse it
    elsewhere. `auto` just stays eager there (keel/engine/compile_policy.py)."""
    if compile_setting(cfg.model.compile) != "true":
        return
    unsupported = unsupported_compile_layout(cfg)
    _require(
        not unsupported,
        f"model.compile: supported for dense models with parallel.tp = pp = sp = cp = 1 "
        f"(data parallel, ZeRO 0-2); set model.compile=false or drop {', '.join(unsupported)}",
    )


def validate_tensor_parallel(cfg: RunConfig) -> None:
    """Heads, kv heads and the MLP width must split evenly over tp; SP shards the sequence over tp."""
    model, tp = cfg.model, cfg.parallel.tp
    if tp == 1:
        return
    _require(
        model.n_heads % tp == 0,
        f"model.n_heads={model.n_heads} must be divisible by parallel.tp={tp}",
    )
    _require(
        model.n_kv_heads % tp == 0 or tp % model.n_kv_heads == 0,
        f"model.n_kv_heads={model.n_kv_heads} and parallel.tp={tp}: one must divide the other "
        "(kv heads are split when tp divides them, replicated when they divide tp)",
    )
    _require(
        model.ffn_dim % tp == 0,
        f"model.ffn_hidden: the MLP width {model.ffn_dim} must be divisible by parallel.tp={tp}",
    )
    expert_width = model.moe_ffn_hidden or model.ffn_dim
    _require(
        not model.moe_experts or expert_width % tp == 0,
        f"model.moe_ffn_hidden: the expert width {expert_width} must be divisible by parallel.tp={tp}",
    )
    if cfg.parallel.sequence_parallel:
        _require(
            cfg.data.seq_len % tp == 0,
            f"data.seq_len={cfg.data.seq_len} must be divisible by parallel.tp={tp} under sequence parallel",
        )


def validate_expert_and_sequence_parallel(cfg: RunConfig) -> None:
    """ep shards the experts (so needs them, evenly); Ulysses sp shards the sequence and, in attention, the heads;
    cp shards the sequence everywhere, in 2·cp chunks (keel/parallel/context.py)."""
    model, parallel = cfg.model, cfg.parallel
    if parallel.ep > 1:
        _require(
            model.moe_experts > 0,
            f"parallel.ep={parallel.ep} needs a mixture-of-experts model: set model.moe_experts",
        )
        _require(
            model.moe_experts % parallel.ep == 0,
            f"model.moe_experts={model.moe_experts} must be divisible by parallel.ep={parallel.ep}",
        )
    if parallel.sp > 1:
        heads = model.n_heads // parallel.tp
        _require(
            heads % parallel.sp == 0,
            f"parallel.sp={parallel.sp} must divide the attention heads per tensor-parallel rank "
            f"(model.n_heads / parallel.tp = {heads})",
        )
    cp = parallel.cp
    _require(
        cp == 1 or cfg.data.seq_len % (2 * cp) == 0,
        f"data.seq_len={cfg.data.seq_len} must be divisible by 2·parallel.cp = {2 * cp} (each context-parallel "
        "rank holds two opposite chunks of the sequence)",
    )
    shards = parallel.sp * (parallel.tp if parallel.sequence_parallel else 1)
    _require(
        (cfg.data.seq_len // cp) % shards == 0,
        f"data.seq_len={cfg.data.seq_len}{f' / parallel.cp={cp}' if cp > 1 else ''} must be divisible by "
        f"{shards} (parallel.sp{' × parallel.tp under sequence_parallel' if parallel.sequence_parallel else ''})",
    )
