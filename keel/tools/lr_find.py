"""LR range test: train briefly while the LR grows exponentially, and read a good peak LR off the loss curve.

The test runs the run's own model, data, DeepSpeed config and optimizer in one process, so the suggestion is for
the configuration that will train, not a stand-in. The loss is smoothed (an EMA, bias-corrected so the first
points are not pulled towards zero) because single-batch losses are too noisy to differentiate. The suggestion is
the LR where the smoothed loss falls fastest per unit of log LR, looking only before the minimum: past the
minimum the loss is rising because the LR is already too high.
"""

from __future__ import annotations

import copy
import csv
import io
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from keel.data import step_batch
from keel.data.blend_prepare import open_splits
from keel.engine.build import build_engine, document_eos
from keel.engine.distributed import init_distributed
from keel.parallel.random import data_parallel_seed, seed_everything
from keel.parallel.topology import Topology
from keel.run_dir import write_atomic

log = logging.getLogger("keel")

SUGGESTION_RULE = (
    "steepest descent: the LR where the smoothed loss falls fastest per unit of log LR, "
    "before the smoothed loss reaches its minimum"
)


@dataclass
class RangeTestResult:
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    stop_reason: str = "completed the sweep"
    beta: float = 0.98  # the smoothing the curve was made with

    @property
    def min_index(self) -> int | None:
        """Index of the lowest finite smoothed loss (None when there is none)."""
        finite = [(s, i) for i, s in enumerate(self.smoothed) if math.isfinite(s)]
        return min(finite)[1] if finite else None

    def suggestion_index(self) -> int | None:
        """Index of the suggested LR (see SUGGESTION_RULE); None when the loss never fell."""
        return steepest_descent_index(self.lrs, self.smoothed)


def sweep_lrs(min_lr: float, max_lr: float, steps: int) -> list[float]:
    """LR_i = min_lr·(max_lr/min_lr)^(i/(steps-1)): evenly spaced in log LR, both ends included."""
    if not 0 < min_lr < max_lr:
        raise ValueError(f"need 0 < min_lr < max_lr, got {min_lr} and {max_lr}")
    if steps < 2:
        raise ValueError(f"need at least 2 steps, got {steps}")
    return [min_lr * (max_lr / min_lr) ** (i / (steps - 1)) for i in range(steps)]


def steepest_descent_index(lrs: list[float], smoothed: list[float]) -> int | None:
    """The i < argmin(smoothed) whose segment to i+1 has the most negative d(smoothed)/d(log lr).

    The suggestion is the segment's lower end, the more cautious of the two. None when no segment falls.
    """
    finite = [(s, i) for i, s in enumerate(smoothed) if math.isfinite(s)]
    if not finite:
        return None
    lowest = min(finite)[1]
    best, best_slope = None, 0.0
    for i in range(lowest):
        slope = (smoothed[i + 1] - smoothed[i]) / (math.log(lrs[i + 1]) - math.log(lrs[i]))
        if slope < best_slope:
            best, best_slope = i, slope
    return best


def range_test(
    step: Callable[[float], float],
    lrs: list[float],
    beta: float = 0.98,
    diverge_factor: float = 4.0,
) -> RangeTestResult:
    """Call `step(lr)` (one optimizer step at `lr`, returning its loss) for each LR until the loss diverges.

    Stops after the first step whose loss is non-finite or whose smoothed loss exceeds `diverge_factor` × the best
    smoothed loss so far; that step is kept in the result so the curve shows where it broke.
    """
    result = RangeTestResult(beta=beta)
    average, best = 0.0, math.inf
    for i, lr in enumerate(lrs):
        loss = float(step(lr))
        average = beta * average + (1.0 - beta) * loss
        smoothed = average / (1.0 - beta ** (i + 1))
        result.lrs.append(lr)
        result.losses.append(loss)
        result.smoothed.append(smoothed)
        if not math.isfinite(smoothed):
            result.stop_reason = f"stopped at step {i}: non-finite loss at lr {lr:.3g}"
            break
        if smoothed > diverge_factor * best:
            result.stop_reason = (
                f"stopped at step {i}: smoothed loss {smoothed:.4g} exceeds "
                f"{diverge_factor:g}× the best {best:.4g} (diverged)"
            )
            break
        best = min(best, smoothed)
    return result


# -- output ---------------------------------------------------------------------------------------------------
def write_csv(path: Path, result: RangeTestResult) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["lr", "loss", "smoothed_loss"])
    for row in zip(result.lrs, result.losses, result.smoothed):
        writer.writerow([repr(v) for v in row])
    write_atomic(path, buffer.getvalue().encode())


def write_plot(path: Path, result: RangeTestResult) -> None:
    """Loss and smoothed loss against log LR, with the suggestion marked."""
    import matplotlib  # optional dependency (the plot extra); cmd_lr_find checks for it before the sweep

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(result.lrs, result.losses, color="0.75", linewidth=1, label="loss")
    ax.plot(
        result.lrs,
        result.smoothed,
        color="C0",
        linewidth=2,
        label=f"smoothed loss (EMA {result.beta:g})",
    )
    index = result.suggestion_index()
    if index is not None:
        lr = result.lrs[index]
        ax.axvline(lr, color="C3", linestyle="--", linewidth=1)
        ax.plot([lr], [result.smoothed[index]], "o", color="C3", label=f"suggested lr {lr:.2e}")
    finite = [v for v in result.losses + result.smoothed if math.isfinite(v)]
    # a diverging tail would flatten the interesting part
    if finite and math.isfinite(result.smoothed[0]):
        start, low = result.smoothed[0], min(finite)
        high = min(max(finite), start + max(start - low, 0.1 * abs(start)))
        pad = 0.05 * max(high - low, 1e-6)
        ax.set_ylim(low - pad, high + pad)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title("LR range test (suggestion: steepest descent before the minimum)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


# -- the test on a real run -----------------------------------------------------------------------------------
def single_process_overrides() -> list[str]:
    """--set values that make any run fit one process: the range test needs no parallelism, only the model.

    Tensor and pipeline parallelism split the same model over ranks, so the LR that suits it is the same at tp=pp=1.
    Resume is off: the range test starts from the initial weights and leaves no checkpoint.
    """
    return [
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.sp=1",
        "parallel.ep=1",
        "parallel.sequence_parallel=false",
        "checkpoint.resume=false",
    ]


def run_lr_find(
    spec, min_lr: float, max_lr: float, steps: int, out_dir: Path, beta: float = 0.98
) -> RangeTestResult:
    """Sweep the LR over `steps` optimizer steps of the run `spec` (a prepared RunSpec) on one process.

    The engine is built with a constant schedule at multiplier 1 and no ramp-up, and each step's LR is written to
    the optimizer's param groups just before the step; DeepSpeed's scheduler step inside engine.step() then only
    resets it to the constant, which the next write replaces. The LR recorded is the one the engine reports.
    """
    cfg = copy.deepcopy(spec.cfg)
    train = cfg.train
    train.lr, train.lr_schedule, train.warmup_steps, train.rampup_start_batch = (
        min_lr,
        "constant",
        0,
        0,
    )
    lrs = sweep_lrs(min_lr, max_lr, steps)
    init_distributed()
    topology = Topology.from_env()
    seed_everything(data_parallel_seed(train.seed, topology))
    samples, order, _ = open_splits(spec.data, cfg.data.seq_len, cfg.data.val_fraction, train.seed)
    engine = build_engine(cfg, spec.ds_raw, topology, document_eos=document_eos(cfg, spec.data))
    n_params = sum(p.numel() for p in engine.module.parameters())
    log.info(
        "lr-find: %.2fM params | %d steps of %d samples | lr %.1e → %.1e",
        n_params / 1e6,
        steps,
        train.global_batch_size,
        min_lr,
        max_lr,
    )
    state = {"step": 0, "used_lrs": []}

    def one_step(lr: float) -> float:
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        state["used_lrs"].append(engine.get_lr()[0])
        batches = step_batch(
            order,
            samples,
            state["step"] * train.global_batch_size,
            train.global_batch_size,
            train.micro_batch_size,
            0,
            1,
        )
        losses = []
        for i, batch in enumerate(batches):
            engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            losses.append(loss.detach().float())
        engine.step()
        state["step"] += 1
        loss = torch.stack(losses).mean().item()
        if state["step"] % 10 == 0 or state["step"] == steps:
            log.info("lr-find step %d/%d | lr %.3e | loss %.4f", state["step"], steps, lr, loss)
        return loss

    result = range_test(one_step, lrs, beta)
    result.lrs = state["used_lrs"]  # what the optimizer was given, read back from the engine
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / "lr_find.csv", result)
    write_plot(out_dir / "lr_find.png", result)
    return result
