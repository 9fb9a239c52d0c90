"""The step line's ETA and MFU: how long the run still needs, and how much of the hardware's peak it uses.

ETA = steps left × the mean wall time of the last 50 steps, where a step's wall time is the step itself plus
the checks, evaluation and checkpoint save around it (`*_time_s` in its metrics record): what a step costs the run.

MFU (model FLOPs utilization, PaLM, Chowdhery et al. 2022, appendix B):

    MFU = tokens/s × (6·N + 12·L·d·s) ÷ (world × peak FLOP/s)

N the parameters one token meets (every dense parameter, the tied embedding once; of each MoE layer's experts,
top_k of E), L layers, d the model width, s the sequence length. 6·N is the matmuls' forward and backward, 12·L·d·s
attention's scores and values. Recomputation under activation checkpointing is not counted: MFU counts the
model's FLOPs, not the hardware's. The peak is `logging.peak_tflops` per device, else the dense bf16 peak of a
known GPU by name (PEAK_TFLOPS), else unknown (CPU, an unlisted device): the line says `mfu n/a`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from keel.config import ModelConfig, RunConfig
from keel.engine.memory_model import Layout, param_share

ETA_WINDOW = 50  # steps averaged for the ETA
# dense bf16 (= fp16) tensor-core peaks in TFLOP/s, by a substring of torch.cuda.get_device_name(); first match wins
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
STEP_COSTS = ("step_time_s", "check_time_s", "eval_time_s", "save_time_s")


def peak_tflops(device_name: str | None, configured: float = 0.0) -> float | None:
    """One device's peak TFLOP/s: `configured` when set (> 0), else the table's for `device_name`, else None."""
    if configured > 0:
        return configured
    for pattern, tflops in PEAK_TFLOPS:
        if device_name and pattern in device_name:
            return tflops
    return None


def flops_per_token(model: ModelConfig, seq_len: int, params: int, expert_params: int = 0) -> float:
    """6·N + 12·L·d·s, with N = `params` − `expert_params` + `expert_params` × top_k / E (the experts a token meets)."""
    active = params - expert_params
    if expert_params and model.moe_experts:
        active += expert_params * model.moe_top_k / model.moe_experts
    return 6.0 * active + 12.0 * model.n_layers * model.dim * seq_len


def run_progress(cfg: RunConfig, world_size: int, device: Any) -> Progress:
    """The run's Progress on `device`: its model counted from a meta-device build of the layer list (no memory)."""
    device = torch.device(device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    share = param_share(cfg.model, Layout())
    flops = flops_per_token(cfg.model, cfg.data.seq_len, share.total, share.expert)
    return Progress(
        cfg.train.steps, flops, world_size, peak_tflops(device_name, cfg.logging.peak_tflops)
    )


def format_eta(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """Keeps the last steps' wall times; says the ETA and MFU of a metrics record."""

    def __init__(
        self, total_steps: int, flops_per_token: float, world_size: int, peak_tflops: float | None
    ):
        self.total_steps = total_steps
        self.flops_per_token = flops_per_token
        self.peak_flops = world_size * peak_tflops * 1e12 if peak_tflops else None
        self._wall = deque(maxlen=ETA_WINDOW)

    def update(self, record: dict[str, Any]) -> tuple[float | None, float]:
        """(MFU as a fraction or None when the peak is unknown, ETA in seconds) after the step `record`."""
        self._wall.append(sum(record.get(key, 0.0) for key in STEP_COSTS))
        eta = (self.total_steps - record["step"]) * sum(self._wall) / len(self._wall)
        mfu = (
            record["tokens_per_s"] * self.flops_per_token / self.peak_flops
            if self.peak_flops
            else None
        )
        return mfu, eta

    def describe(self, record: dict[str, Any]) -> str:
        mfu, eta = self.update(record)
        return f"mfu {'n/a' if mfu is None else f'{mfu:.1%}'} | eta {format_eta(eta)}"
