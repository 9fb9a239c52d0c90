"""Drawing `keel report`'s plots with matplotlib (the `plot` extra), each from its series alone.

Every function takes the series dict of keel/tools/report/series.py and returns PNG bytes: what is drawn is exactly
what series.json holds. The loss axis is fitted to the losses of applied steps and validation, so a spike of a
skipped or rolled-back step (often 1000× the loss) marks its step without flattening the curve.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import matplotlib
from matplotlib.ticker import FormatStrFormatter, LogLocator, MaxNLocator, NullFormatter

SIZE = (9, 4.5)  # inches, at DPI: 900 × 450 pixels
DPI = 100


def _pyplot():
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot must not pick a display backend

    return plt


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    _pyplot().close(fig)
    return buffer.getvalue()


def _points(column: dict[str, list]) -> tuple[list, list]:
    pairs = [(s, v) for s, v in zip(column["step"], column["value"]) if v is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _fit_ylim(ax, values: list[float]) -> None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if finite:
        low, high = min(finite), max(finite)
        pad = 0.05 * max(high - low, 1e-6 * max(abs(high), 1.0))
        ax.set_ylim(low - pad, high + pad)


def _mark_steps(ax, steps: list[int], label: str, color: str, style: str) -> None:
    for i, step in enumerate(sorted(set(steps))):
        ax.axvline(
            step,
            color=color,
            linestyle=style,
            linewidth=1,
            alpha=0.8,
            label=label if i == 0 else None,
        )


def _plain_log_ticks(ax) -> None:
    """Log-scale ticks at 1, 2, 5 × 10ᵏ labelled as plain numbers (0.5, 0.02), not 5×10⁻¹."""
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _finish(ax, title: str, ylabel: str, legend: bool = True) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def draw_loss(s: dict[str, Any]) -> bytes:
    fig, ax = _pyplot().subplots(figsize=SIZE)
    for rollback in s["rollbacks"]:
        ax.axvspan(
            rollback["to_step"],
            rollback["step"],
            color="0.6",
            alpha=0.2,
            label="rolled back (retrained)" if rollback is s["rollbacks"][0] else None,
        )
    if s["rolled_back"]["step"]:
        ax.plot(
            *_points(s["rolled_back"]),
            ".",
            color="0.5",
            markersize=3,
            label="loss of rolled-back steps",
        )
    ax.plot(*_points(s["train"]), color="C0", linewidth=1, alpha=0.35, label="train loss")
    ax.plot(
        *_points(s["smoothed"]),
        color="C0",
        linewidth=1.8,
        label=f"train loss, smoothed (EMA {s['smoothed']['weight']:.3g})",
    )
    if s["val"]["step"]:
        ax.plot(*_points(s["val"]), "o-", color="C1", markersize=4, label="validation loss")
    _mark_steps(ax, [m["step"] for m in s["skipped"]], "skipped step", "C3", ":")
    _mark_steps(ax, s["resumes"], "resumed", "C2", "--")
    skipped = {m["step"] for m in s["skipped"] if not m["rolled_back"]}
    updated = [v for step, v in zip(s["train"]["step"], s["train"]["value"]) if step not in skipped]
    _fit_ylim(ax, (updated or s["train"]["value"]) + s["val"]["value"])
    _finish(ax, "Loss", "loss")
    return _png(fig)


def draw_lr(s: dict[str, Any]) -> bytes:
    fig, ax = _pyplot().subplots(figsize=SIZE)
    ax.plot(*_points(s["lr"]), color="C0", linewidth=1.5)
    _finish(ax, "Learning rate", "lr", legend=False)
    return _png(fig)


def draw_grad_norm(s: dict[str, Any]) -> bytes:
    plt = _pyplot()
    panels = 2 if s["per_layer"] else 1
    fig, axes = plt.subplots(
        panels, 1, figsize=(SIZE[0], SIZE[1] * (1.6 if panels == 2 else 1)), squeeze=False
    )
    ax = axes[0][0]
    if s["grad_norm"]["step"]:
        ax.plot(*_points(s["grad_norm"]), color="C0", linewidth=1, label="global gradient norm")
    _mark_steps(ax, s["skipped"], "skipped step", "C3", ":")
    _finish(ax, "Gradient norm (before clipping)", "norm")
    if panels == 2:
        ax = axes[1][0]
        for name, column in s["per_layer"].items():
            ax.plot(*_points(column), "o-", markersize=3, linewidth=1, label=name)
        ax.set_yscale("log")
        _plain_log_ticks(ax)
        _finish(ax, "Per-layer gradient norm (model monitor)", "norm")
    fig.tight_layout()
    return _png(fig)


def draw_loss_scale(s: dict[str, Any]) -> bytes:
    fig, ax = _pyplot().subplots(figsize=SIZE)
    ax.plot(
        *_points(s["loss_scale"]),
        color="C0",
        linewidth=1.5,
        drawstyle="steps-post",
        label="loss scale",
    )
    _mark_steps(ax, s["skipped"], "skipped step (overflow)", "C3", ":")
    ax.set_yscale("log", base=2)
    _finish(ax, "fp16 dynamic loss scale", "scale")
    return _png(fig)


def draw_throughput(s: dict[str, Any]) -> bytes:
    fig, axes = _pyplot().subplots(2, 1, figsize=(SIZE[0], SIZE[1] * 1.6), sharex=True)
    axes[0].plot(*_points(s["tokens_per_s"]), color="C0", linewidth=1)
    _finish(axes[0], "Throughput", "tokens/s", legend=False)
    axes[1].plot(*_points(s["step_time_s"]), color="C1", linewidth=1)
    _finish(axes[1], "Step time (rank 0)", "seconds", legend=False)
    fig.tight_layout()
    return _png(fig)


def draw_stragglers(s: dict[str, Any]) -> bytes:
    fig, ax = _pyplot().subplots(figsize=SIZE)
    for end, color in (("slowest", "C3"), ("fastest", "C2")):
        ax.plot(*_points(s[end]), "o-", color=color, markersize=4, linewidth=1, label=f"{end} rank")
    # the slowest rank's index at each check: a rank named again and again is the one to drain
    for step, value, rank in zip(s["slowest"]["step"], s["slowest"]["value"], s["slowest"]["rank"]):
        if value is not None and rank is not None:
            ax.annotate(
                str(rank), (step, value), fontsize=7, xytext=(0, 4), textcoords="offset points"
            )
    _finish(ax, "Slowest and fastest rank's step time (at each straggler check)", "seconds")
    return _png(fig)


def draw_experts(s: dict[str, Any]) -> bytes:
    plt = _pyplot()
    layers = s["layers"]
    fig, axes = plt.subplots(
        len(layers), 1, figsize=(SIZE[0], 2.6 * len(layers) + 1), squeeze=False
    )
    for ax, (layer, entry) in zip(axes[:, 0], layers.items()):
        experts = len(entry["share"][0])
        for expert in range(experts):
            ax.plot(
                entry["step"],
                [row[expert] for row in entry["share"]],
                "o-",
                markersize=3,
                linewidth=1,
                label=f"expert {expert}",
            )
        ax.axhline(1 / experts, color="0.5", linestyle="--", linewidth=1, label="uniform")
        _finish(ax, f"MoE layer {layer[1:]}: share of routed rows per expert", "share")
    fig.tight_layout()
    return _png(fig)


def draw_fp8(s: dict[str, Any]) -> bytes:
    """One panel per operand: each FP8 block's fraction of values below the format's normal range (solid) and
    clipped (dotted) at every monitor step; the FP8 health warnings marked."""
    plt = _pyplot()
    operands = list(s["underflow"])
    fig, axes = plt.subplots(
        len(operands), 1, figsize=(SIZE[0], SIZE[1] * 0.8 * len(operands)), squeeze=False
    )
    for ax, operand in zip((row[0] for row in axes), operands):
        for i, (block, column) in enumerate(s["underflow"][operand].items()):
            ax.plot(
                *_points(column), "o-", markersize=3, linewidth=1, color=f"C{i % 10}", label=block
            )
            clipped = s["saturated"].get(operand, {}).get(block)
            if clipped and any(v for v in clipped["value"] if v):
                ax.plot(*_points(clipped), ":", linewidth=1, color=f"C{i % 10}")
        warned = [w["step"] for w in s["warned"] if w["operand"] == operand]
        _mark_steps(ax, warned, "FP8 health warning", "C3", "--")
        _finish(ax, f"FP8 {operand}: below the normal range (solid), clipped (dotted)", "fraction")
    fig.tight_layout()
    return _png(fig)


# goodput's kinds of time, in one color each (productive first)
GOODPUT_COLORS = {
    "productive": "C2",
    "start-up": "C0",
    "restore": "C9",
    "steps re-done after a failure": "C3",
    "rollbacks": "C1",
    "skipped steps": "C6",
    "checkpoint stalls": "C4",
    "evaluation": "C8",
    "checks": "C7",
    "preflight": "C5",
    "between launches": "0.3",
}


def draw_goodput(s: dict[str, Any]) -> bytes:
    """The run's wall time from its first launch as one bar: what each stretch went to."""
    fig, ax = _pyplot().subplots(figsize=SIZE)
    seen = set()
    for span in s["spans"]:
        what = span["what"]
        ax.broken_barh(
            [(span["start"], max(span["seconds"], s["wall_s"] / 2000))],
            (0, 1),
            color=GOODPUT_COLORS.get(what, "0.6"),
            label=what if what not in seen else None,
        )
        seen.add(what)
    ax.set_xlim(0, max(s["wall_s"], 1e-6))
    ax.set_yticks([])
    ax.set_xlabel("wall time since the first launch (s)")
    ax.set_title(f"Goodput {s['fraction']:.1%} of {s['wall_s']:.0f} s ({s['launches']} launch(es))")
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    return _png(fig)


DRAW: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "loss": draw_loss,
    "lr": draw_lr,
    "grad_norm": draw_grad_norm,
    "loss_scale": draw_loss_scale,
    "throughput": draw_throughput,
    "stragglers": draw_stragglers,
    "experts": draw_experts,
    "fp8": draw_fp8,
    "goodput": draw_goodput,
}
