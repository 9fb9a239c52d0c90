"""Every torchao internal Keel uses for FP8 and MX training, in one place (as torch_internals.py is for torch).

torchao's public FP8 API is a module swap (`convert_to_float8_training` turns `nn.Linear`s into `Float8Linear`s
whose scales see only the local tensor); Keel's linears are its own tensor-parallel modules whose scales must see
the whole logical tensor (keel/parallel/float8.py). So Keel keeps torchao's recipes, casts, emulated and
`_scaled_mm` GEMMs, and MX autograd function, and computes the amax itself: that needs the pieces below, which
torchao marks as not public. torchao is imported lazily (only a run with `model.fp8` set needs it), and
`check_torchao` names the first piece an installed version lacks, in one line.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from typing import Any

# the torchao releases these internals were verified against (setup.py's `fp8` extra pins the same range)
VERIFIED = ((0, 18), (0, 19))

# (module, attribute) Keel reads; each is probed by `check_torchao`
INTERNALS = [
    ("torchao.float8", "Float8LinearConfig"),
    ("torchao.float8.config", "ScalingGranularity"),
    ("torchao.float8.config", "ScalingType"),
    ("torchao.float8.float8_training_tensor", "hp_tensor_and_scale_to_float8"),
    ("torchao.float8.float8_training_tensor", "GemmInputRole"),
    ("torchao.float8.float8_training_tensor", "LinearMMConfig"),
    ("torchao.float8.float8_training_tensor", "ScaledMMConfig"),
    ("torchao.float8.float8_utils", "tensor_to_amax"),
    ("torchao.float8.float8_utils", "amax_to_scale"),
    ("torchao.prototype.moe_training.mxfp8_linear", "mx_mm"),
    ("torchao.prototype.mx_formats.config", "MXFP8Dim0CastKernelChoice"),
    ("torchao.prototype.mx_formats.config", "MXFP8Dim1CastKernelChoice"),
    ("torchao.prototype.mx_formats.config", "ScaleCalculationMode"),
    ("torchao.quantization.quantize_.common.kernel_preference", "KernelPreference"),
]


class TorchaoError(RuntimeError):
    """torchao is missing, or lacks an internal Keel's FP8 path reads."""


def installed_version() -> tuple[int, int] | None:
    if importlib.util.find_spec("torchao") is None:
        return None
    from importlib.metadata import version

    major, minor, *_ = (version("torchao").split("+")[0] + ".0.0").split(".")
    return int(major), int(minor)


def problem() -> str | None:
    """Why `model.fp8` cannot run here, in one line, or None. Cheap when torchao is absent (no import)."""
    found = installed_version()
    low, high = VERIFIED
    if found is None:
        return "torchao is not installed: pip install 'keel[fp8]'"
    if not low <= found < high:
        return (
            f"torchao {found[0]}.{found[1]} is outside the range Keel's FP8 path was verified with "
            f"(>={low[0]}.{low[1]},<{high[0]}.{high[1]}): pip install 'keel[fp8]'"
        )
    try:
        _load()
    except TorchaoError as exc:
        return str(exc)
    return None


@functools.cache
def _load() -> dict[str, Any]:
    # torchao logs, at import, each CUDA extension it cannot load (on a CPU, or a GPU another build targets,
    # every one, and none is on a path Keel takes), and torch a deprecation of how torchao registers its enums:
    # warnings that would only alarm a user
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        found = {}
        for module, name in INTERNALS:
            try:
                found[name] = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as exc:
                raise TorchaoError(
                    f"the installed torchao has no {module}.{name} ({exc.__class__.__name__}), which "
                    "Keel's FP8 path needs: pip install 'keel[fp8]'"
                ) from exc
        return found
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


def check_torchao() -> None:
    """Raise TorchaoError naming the first missing piece (what an engine build with `model.fp8` calls)."""
    why = problem()
    if why is not None:
        raise TorchaoError(why)


def get(name: str) -> Any:
    """One of INTERNALS by its attribute name (torchao imported on first use)."""
    return _load()[name]


def linear_config(recipe: str, emulate: bool) -> Any:
    """torchao's `Float8LinearConfig` for one of its recipe names, emulated or on `_scaled_mm`."""
    import dataclasses

    config = get("Float8LinearConfig").from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate)


def mm_config(config: Any) -> Any:
    """The `LinearMMConfig` (output, grad-input, grad-weight GEMM settings) `Float8Linear` builds from a config."""
    scaled = get("ScaledMMConfig")
    gemms = (
        config.gemm_config_output,
        config.gemm_config_grad_input,
        config.gemm_config_grad_weight,
    )
    return get("LinearMMConfig")(
        *(scaled(config.emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemms)
    )


def mx_matmul_function() -> Any:
    """`matmul(x, weight, element_dtype, emulate)`: x @ weightᵀ with x, the weight and the gradients cast to MX
    blocks of 32 along each GEMM's reduction dim (torchao's MX autograd function); `element_dtype` float8_e4m3fn
    (MXFP8) or float4_e2m1fn_x2 (MXFP4). torchao's pieces are resolved now, so a forward that torch.compile traces
    finds no lookup in it."""
    mx_mm, preference = get("mx_mm"), get("KernelPreference")
    dim0, dim1 = get("MXFP8Dim0CastKernelChoice"), get("MXFP8Dim1CastKernelChoice")
    rceil = get("ScaleCalculationMode").RCEIL

    def matmul(x: Any, weight: Any, element_dtype: Any, emulate: bool) -> Any:
        return mx_mm.apply(
            x,
            weight,
            element_dtype,
            element_dtype,
            element_dtype,
            32,
            preference.EMULATED if emulate else preference.AUTO,
            dim0.TORCH if emulate else dim0.TRITON,
            dim1.TORCH if emulate else dim1.CUDA,
            rceil,
            False,
        )

    return matmul
