"""Run configuration: one YAML file mapped onto dataclasses (`schema`) and the rules they must satisfy (`rules`).

The package imports nothing else from keel (it is the bottom of the house), so any module may import its config,
and each rule has one home: a module that needs a rule at run time calls the function here instead of restating
it. Import public names from `keel.config`.

Where a new field goes, in order:
1. `schema.py`: the field on its section's dataclass, with its default and a comment saying what it does; a
   choice field's values in `CHOICES`.
2. `bounds.py`: a numeric field's range, one row of the table (the fuzzer and the error line read it).
3. `rules.py`: any rule between fields (one function per concern, called from `validate`), refused in one line
   that names the field and what to set.
4. tests/faults/test_config_fuzz.py draws from the schema, the bounds and the choices; a new rule between fields
   needs its valid configs drawn there too, or the fuzzer's valid draws will start failing.
"""

from keel.config.rules import (
    clamp_warmup,
    parse_skip_range,
    validate,
    validate_batch_split,
    validate_expert_and_sequence_parallel,
    validate_faults,
    validate_fields,
    validate_layout,
    validate_model,
    validate_moe,
    validate_schedule,
    validate_schedule_choices,
    validate_tensor_parallel,
    validate_world_size,
)
from keel.config.schema import (
    FP8_RECIPES,
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
    SECTIONS,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    FaultsConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    StabilityConfig,
    TrainConfig,
    apply_overrides,
    build_config,
    load_config,
)

__all__ = [
    "INITS",
    "LR_SCHEDULES",
    "MOE_DROP_POLICIES",
    "MOE_SCORINGS",
    "FP8_RECIPES",
    "KERNELS",
    "NORM_PLACEMENTS",
    "NORMS",
    "PARALLEL_AXES",
    "PIPELINE_PARTITIONS",
    "RAMPUP_SCALINGS",
    "SECTIONS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "FaultsConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "StabilityConfig",
    "TrainConfig",
    "apply_overrides",
    "build_config",
    "clamp_warmup",
    "load_config",
    "validate",
    "validate_batch_split",
    "parse_skip_range",
    "validate_expert_and_sequence_parallel",
    "validate_faults",
    "validate_fields",
    "validate_layout",
    "validate_model",
    "validate_moe",
    "validate_schedule",
    "validate_schedule_choices",
    "validate_tensor_parallel",
    "validate_world_size",
]
