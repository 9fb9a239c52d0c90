"""DeepSpeed's ZeRO-3 checkpoint readers, for `keel export` of one tensor-parallel rank's partitions."""

from __future__ import annotations

from typing import Any

import deepspeed
from deepspeed.utils import zero_to_fp32

from keel.adapters.deepspeed_internals import DeepSpeedInternalsError

ZERO3_READERS = (
    "parse_model_states",
    "parse_optim_states",
    "_get_fp32_state_dict_from_zero3_checkpoint",
)


def zero3_fp32_state(model_files: list, optim_files: list, checkpoint_dir: str) -> dict[str, Any]:
    """name → lazy fp32 tensor (`.contiguous()` gathers it from every dp rank's memory-mapped partition) for one
    tp rank's ZeRO-3 files. Missing public API: `get_fp32_state_dict_from_zero_checkpoint` globs every
    `*_model_states.pt` of the directory, so it cannot read one tp rank of a tp > 1 checkpoint; its per-rank
    steps (`parse_model_states`, `parse_optim_states`) are public, the merge is `_get_fp32_state_dict_from_zero3_
    checkpoint`."""
    for name in ZERO3_READERS:
        if not callable(getattr(zero_to_fp32, name, None)):
            raise DeepSpeedInternalsError(
                f"DeepSpeed {deepspeed.__version__} has no `zero_to_fp32.{name}`, which "
                "keel export uses to read ZeRO-3 partitions; install a DeepSpeed in the "
                "range setup.py pins"
            )
    model_states = zero_to_fp32.parse_model_states([str(f) for f in model_files])
    stage, world_size, flat_groups, _ = zero_to_fp32.parse_optim_states(
        [str(f) for f in optim_files], checkpoint_dir
    )
    if stage != 3:
        raise ValueError(f"{checkpoint_dir}: expected ZeRO-3 optimizer states, found stage {stage}")
    return zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(
        world_size, flat_groups, model_states, False
    )
