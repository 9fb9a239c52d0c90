"""`model.compile: auto | true | false` — whether this run's blocks go through `torch.compile`.

`true` compiles or refuses (keel/config/rules.py, keel/engine/ds_config.py say what to change); `false` never
compiles. `auto`, the default, compiles only where it was measured to win on wall time, compilation included
(bench/results/compile_cpu_20261202.md): on the 128-wide default model the first compilation is not paid back in
1000 steps, on 256-wide and wider blocks it is. So: on the CPU (inductor's C++ kernels, a C++ compiler on PATH),
fp32, dense blocks with tp = pp = sp = 1, ZeRO 0-2, model.dim >= 256 and train.steps >= 1000. On CUDA `auto`
stays eager: one shape is measured (bench/results/device_check_gpu_20261204.md: 5.6% per step in bf16, paid back
after ~1,300 steps), not yet a rule; bf16/fp16 and the other layouts are unmeasured or unsupported, and stay eager.
"""

from __future__ import annotations

import shutil

import torch

from keel.config import RunConfig
from keel.config.rules import compile_setting, unsupported_compile_layout

# the narrowest width measured to pay its compilation back (bench/results/compile_cpu_*.md)
MIN_DIM = 256
MIN_STEPS = 1000  # the yardstick: a win over a 1000-step run, compilation included


def should_compile(cfg: RunConfig, zero_stage: int, precision: str) -> tuple[bool, str]:
    """(compile?, why) for the resolved run: `precision` is "fp32", "bf16" or "fp16"."""
    setting = compile_setting(cfg.model.compile)
    if setting != "auto":
        return setting == "true", f"model.compile={setting}"
    reasons = unsupported_compile_layout(cfg)
    if torch.cuda.is_available():
        reasons.append("CUDA (not measured yet)")
    if zero_stage == 3:
        reasons.append("ZeRO-3")
    if cfg.model.fp8 != "off":
        reasons.append(f"model.fp8={cfg.model.fp8} (not measured compiled)")
    if precision != "fp32":
        reasons.append(precision)
    if cfg.model.dim < MIN_DIM:
        reasons.append(f"model.dim < {MIN_DIM}")
    if cfg.train.steps < MIN_STEPS:
        reasons.append(f"train.steps < {MIN_STEPS}")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        reasons.append("no C++ compiler on PATH")
    if reasons:
        return False, f"model.compile=auto: eager ({', '.join(reasons)})"
    return (
        True,
        "model.compile=auto: compiled (CPU, fp32, dense, tp = pp = sp = 1, ZeRO 0-2, a long enough run)",
    )
