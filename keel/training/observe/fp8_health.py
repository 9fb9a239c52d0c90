"""FP8 health: how much of each FP8 block's input activations, weights and gradients the casts lose, on monitor
steps.

A dynamically scaled cast maps a tensor's amax to the format's largest value. One outlier — the "massive
activations" of large-model pretraining, or a diverging weight — stretches the scale, and the ordinary values
below it fall under the format's normal range: they keep one or two mantissa bits, or become zero, and the layer
computes on noise while the loss still looks fine. The monitor arms a probe on each FP8 linear of the blocks this
rank holds (keel/parallel/float8.py records, per operand, the fraction of non-zero values below the normal range
and the fraction clipped at the format's maximum, in place on the device); `read` takes each block's worst linear
per operand, the monitor reduces them in its existing max all-reduce, and `Fp8HealthWarning` turns them into one
anomaly per block and operand, naming the layer.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from keel.config import StabilityConfig
from keel.parallel.float8 import PROBE_ROLES, PROBE_STATS, new_probe
from keel.run_dir import AnomalyLog

log = logging.getLogger("keel")
PREFIX = "fp8/"
ROLE_NAMES = {"x": "input activations", "w": "weights", "g": "output gradients"}


class Fp8Probes:
    """The probes of the FP8 linears of the blocks this rank holds: `arm` before a monitor step's forward passes,
    `read` after its backward passes."""

    def __init__(
        self, blocks: list[tuple[int, Any]], n_layers_total: int, device: torch.device
    ) -> None:
        self.linears = [
            (index, module)
            for index, block in blocks
            for module in block.modules()
            if getattr(module, "fp8", None) is not None
        ]
        self.n_layers_total = n_layers_total
        self.device = device

    def arm(self) -> None:
        for _, module in self.linears:
            module.fp8_probe = new_probe(self.device)

    def read(self) -> torch.Tensor:
        """[layer × role × stat] flattened: each block's worst linear (-1 where this rank holds no FP8 linear of
        that layer, so a max over ranks keeps the holder's value); disarms."""
        values = torch.full(
            (self.n_layers_total, len(PROBE_ROLES), len(PROBE_STATS)),
            -1.0,
            dtype=torch.float64,
            device=self.device,
        )
        for index, module in self.linears:
            if module.fp8_probe is not None:
                values[index] = torch.maximum(values[index], module.fp8_probe.double())
                module.fp8_probe = None
        return values.flatten()

    def disarm(self) -> None:
        for _, module in self.linears:
            module.fp8_probe = None

    @staticmethod
    def record(names: list[str], values: list[float]) -> dict[str, float]:
        """The metrics record's `fp8/<layer>/<role>/<stat>` entries from `read`'s reduced values."""
        width = len(PROBE_ROLES) * len(PROBE_STATS)
        out = {}
        for index, name in enumerate(names):
            row = values[index * width : (index + 1) * width]
            if row and row[0] >= 0:  # -1: no rank holds an FP8 linear of this layer
                keys = (f"{PREFIX}{name}/{r}/{s}" for r in PROBE_ROLES for s in PROBE_STATS)
                out.update(zip(keys, row))
        return out


class Fp8HealthWarning:
    """Warns once per block and operand when the fraction of its non-zero values an FP8 cast puts below the
    format's normal range (fewer mantissa bits, or zero) passes
    `stability.fp8_underflow_warn`, or the fraction it clips passes `stability.fp8_saturation_warn`. The values
    are the same on every rank (reduced by the monitor), so every rank decides alike; rank 0 writes the anomaly."""

    def __init__(self, stability: StabilityConfig, anomalies: AnomalyLog, recipe: str) -> None:
        self.limits = {
            # mxfp4 (one mantissa bit, 2.6 normal binades) keeps ~40% of a clean block below its normal range:
            # its fractions are recorded and plotted, but no fixed threshold tells a clean block from a bad one
            "underflow": 0.0 if recipe == "mxfp4" else stability.fp8_underflow_warn,
            "saturated": stability.fp8_saturation_warn,
        }
        self.anomalies = anomalies
        self.warned: set[tuple[str, str, str]] = set()

    def check(self, step: int, record: dict[str, Any]) -> list[str]:
        """The `layer/role/stat` entries that warned at this step (each at most once per run)."""
        fired = []
        for key, value in record.items():
            if not key.startswith(PREFIX):
                continue
            layer, role, stat = key[len(PREFIX) :].rsplit("/", 2)
            limit = self.limits[stat]
            if limit <= 0 or value <= limit or (layer, role, stat) in self.warned:
                continue
            self.warned.add((layer, role, stat))
            fired.append(f"{layer}/{role}/{stat}")
            self.anomalies.record(
                "fp8_health", step, layer=layer, operand=ROLE_NAMES[role], stat=stat, fraction=value
            )
            if self.anomalies.rank == 0:
                what = (
                    "below the format's normal range"
                    if stat == "underflow"
                    else "clipped at the format's maximum"
                )
                log.warning(
                    "step %d: %s's FP8 casts lose its %s: %.1f%% of the values %s (stability.fp8_%s_warn="
                    "%g) — an outlier is stretching the scale; a finer recipe (rowwise), model.fp8_skip_blocks "
                    "or model.fp8=off for this block",
                    step,
                    layer,
                    ROLE_NAMES[role],
                    100 * value,
                    what,
                    "underflow" if stat == "underflow" else "saturation",
                    limit,
                )
        return fired
