"""Run configuration: one YAML file mapped onto dataclasses (`schema`) and the rules they must satisfy (`validate`).

The two halves import nothing else from keel, so any module may import its config without an import cycle, and
each rule has one home: a module that needs a rule at run time calls the function here instead of restating it.
Import public names from `keel.config`; note that `keel.config.validate` is the function, which shadows the
submodule of the same name (use `from keel.config.validate import ...` to reach the module itself).
"""

from keel.config.schema import (
    INITS,
    LR_SCHEDULES,
    MOE_DROP_POLICIES,
    MOE_SCORINGS,
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
from keel.config.validate import (
    validate,
    validate_batch_split,
    validate_expert_and_sequence_parallel,
    validate_layout,
    validate_model,
    validate_moe,
    validate_schedule,
    validate_schedule_choices,
    validate_tensor_parallel,
    validate_world_size,
)

__all__ = [
    "INITS",
    "LR_SCHEDULES",
    "MOE_DROP_POLICIES",
    "MOE_SCORINGS",
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
    "load_config",
    "validate",
    "validate_batch_split",
    "validate_expert_and_sequence_parallel",
    "validate_layout",
    "validate_model",
    "validate_moe",
    "validate_schedule",
    "validate_schedule_choices",
    "validate_tensor_parallel",
    "validate_world_size",
]
