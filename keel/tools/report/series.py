"""The numbers each plot of `keel report` draws, taken from a run's records (no drawing here).

Every plot is either a dict of series (what keel/tools/report/plots.py draws, and what series.json holds, exactly) or
a `Skipped` reason. Non-finite values (a NaN loss of a skipped step) become None: JSON has no NaN, and a plot
draws no point for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from keel.run_dir.goodput import account
from keel.tools.report.read import RunRecords

# the model monitor's per-layer gradient norms (keel/training/observe/monitor.py)
GRAD_NORM_PREFIX = "grad_norm/"


@dataclass(frozen=True)
class Skipped:
    reason: str


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _column(records: list[dict[str, Any]], key: str) -> dict[str, list]:
    """{"step": [...], "value": [...]} for the records holding `key` as a number or null."""
    rows = [r for r in records if key in r and "step" in r]
    return {"step": [r["step"] for r in rows], "value": [_number(r[key]) for r in rows]}


def _has_values(column: dict[str, list]) -> bool:
    return any(v is not None for v in column["value"])


def _markers(run: RunRecords) -> dict[str, list]:
    """The steps a plot marks: skipped updates (kept and rolled-back records alike), rollbacks and resumes."""
    skipped = [
        {"step": r["step"], "loss": _number(r.get("loss")), "rolled_back": source == "discarded"}
        for source, lines in (("kept", run.metrics), ("discarded", run.discarded))
        for r in lines.records
        if r.get("skipped") and "step" in r
    ]
    events = run.anomalies.records
    rollbacks = [
        {"step": e["step"], "to_step": e["to_step"]}
        for e in events
        if e.get("kind") == "rollback" and e.get("done") and "to_step" in e
    ]
    resumes = [e["step"] for e in events if e.get("kind") == "resume"]
    return {
        "skipped": sorted(skipped, key=lambda m: (m["step"], m["rolled_back"])),
        "rollbacks": rollbacks,
        "resumes": resumes,
    }


def loss_series(run: RunRecords) -> dict | Skipped:
    """Every step's loss (a skipped step's too: the batch was trained on, its update dropped), the validation
    losses, the rolled-back steps' losses, and the markers."""
    records = run.metrics.records
    train = _column(records, "loss")
    if not _has_values(train):
        return Skipped("no training loss in metrics.jsonl yet")
    return {
        "train": train,
        "smoothed": smoothed(train),
        "val": _column(records, "val_loss"),
        "rolled_back": _column(run.discarded.records, "loss"),
        **_markers(run),
    }


def smoothed(column: dict[str, list]) -> dict[str, Any]:
    """TensorBoard's smoothing of a noisy curve: an exponential moving average, debiased at the start, over the
    finite values; its weight spans about 1 % of the run's points (0.8 at 500 points or fewer, 0.99 at 10,000),
    so a long run's line is as readable as a short one's."""
    points = [(s, v) for s, v in zip(column["step"], column["value"]) if v is not None]
    weight = 1.0 - 1.0 / max(5.0, len(points) / 100)
    average, steps, values = 0.0, [], []
    for n, (step, value) in enumerate(points, start=1):
        average = weight * average + (1.0 - weight) * value
        steps.append(step)
        values.append(average / (1.0 - weight**n))
    return {"step": steps, "value": values, "weight": weight}


def lr_series(run: RunRecords) -> dict | Skipped:
    lr = _column(run.metrics.records, "lr")
    return {"lr": lr} if _has_values(lr) else Skipped("no learning rate in metrics.jsonl yet")


def grad_norm_series(run: RunRecords) -> dict | Skipped:
    records = run.metrics.records
    norm = _column(records, "grad_norm")
    layers = sorted(
        {k[len(GRAD_NORM_PREFIX) :] for r in records for k in r if k.startswith(GRAD_NORM_PREFIX)},
        key=_layer_order,
    )
    per_layer = {name: _column(records, GRAD_NORM_PREFIX + name) for name in layers}
    if not _has_values(norm) and not per_layer:
        return Skipped(
            "no finite gradient norm in metrics.jsonl (every step overflowed, or none is computed on "
            "this path)"
        )
    return {
        "grad_norm": norm,
        "per_layer": per_layer,
        "skipped": [m["step"] for m in _markers(run)["skipped"] if not m["rolled_back"]],
    }


def _layer_order(name: str) -> tuple[int, int]:
    """embedding, block0 … blockN, final_norm, head: the model's order, not the alphabet's."""
    if name.startswith("block") and name[5:].isdigit():
        return 1, int(name[5:])
    return {"embedding": (0, 0), "final_norm": (2, 0), "head": (3, 0)}.get(name, (4, 0))


def loss_scale_series(run: RunRecords) -> dict | Skipped:
    scale = _column(run.metrics.records, "loss_scale")
    if not _has_values(scale):
        return Skipped("no loss scale recorded: not an fp16 run (bf16 and fp32 need none)")
    return {
        "loss_scale": scale,
        "skipped": [r["step"] for r in run.metrics.records if r.get("skipped")],
    }


def throughput_series(run: RunRecords) -> dict | Skipped:
    records = run.metrics.records
    tokens = _column(records, "tokens_per_s")
    if not _has_values(tokens):
        return Skipped("no throughput in metrics.jsonl yet")
    return {"tokens_per_s": tokens, "step_time_s": _column(records, "step_time_s")}


def stragglers_series(run: RunRecords) -> dict | Skipped:
    """The slowest and fastest rank's step time at each straggler check (the check reduces the world to its
    extremes: a line per rank would not be readable at 1,024 ranks, nor cheap to gather)."""
    checks = [r for r in run.metrics.records if _number(r.get("step_time_max")) is not None]
    if not checks:
        interval = run.config.get("stability", {}).get("straggler_interval")
        return Skipped(
            f"no straggler check in the run yet (stability.straggler_interval={interval}; the checks "
            "name the slowest and fastest rank)"
        )
    steps = [r["step"] for r in checks]
    return {
        end: {
            "step": steps,
            "value": [_number(r.get(f"step_time_{bound}")) for r in checks],
            "rank": [r.get(f"{end}_rank") for r in checks],
        }
        for end, bound in (("slowest", "max"), ("fastest", "min"))
    }


def experts_series(run: RunRecords) -> dict | Skipped:
    """Each MoE layer's share of the routed rows per expert, at every expert-health record."""
    layers: dict[str, dict[str, list]] = {}
    for r in run.metrics.records:
        for layer, health in (r.get("moe") or {}).items():
            counts = health.get("tokens_per_expert") if isinstance(health, dict) else None
            if not counts:
                continue
            total = sum(counts) or 1
            entry = layers.setdefault(layer, {"step": [], "share": []})
            entry["step"].append(r["step"])
            entry["share"].append([c / total for c in counts])
    if not layers:
        return Skipped(
            "no MoE expert loads in metrics.jsonl (a dense model, or no expert-health record yet)"
        )
    return {
        "layers": dict(
            sorted(layers.items(), key=lambda kv: int(kv[0][1:]) if kv[0][1:].isdigit() else 0)
        )
    }


# the model monitor's FP8 health (keel/training/observe/fp8_health.py): fp8/<block>/<operand>/<stat>
FP8_PREFIX = "fp8/"
FP8_OPERANDS = {"x": "input activations", "w": "weights", "g": "output gradients"}


def fp8_series(run: RunRecords) -> dict | Skipped:
    """Per operand, each FP8 block's fraction of values below the format's normal range (and clipped), at every
    monitor step; the blocks the FP8 health warning named."""
    records = run.metrics.records
    keys = sorted({k for r in records for k in r if k.startswith(FP8_PREFIX)})
    if not keys:
        return Skipped(
            "no FP8 health in metrics.jsonl (model.fp8=off, or no monitor step yet: "
            "stability.monitor_interval)"
        )
    out: dict[str, dict[str, dict[str, dict[str, list]]]] = {}
    for key in keys:
        block, operand, stat = key[len(FP8_PREFIX) :].rsplit("/", 2)
        per_block = out.setdefault(stat, {}).setdefault(FP8_OPERANDS.get(operand, operand), {})
        per_block[block] = _column(records, key)
    order = list(
        FP8_OPERANDS.values()
    )  # activations, weights, gradients; blocks in the model's order
    for name, stat in out.items():
        out[name] = {
            operand: dict(sorted(stat[operand].items(), key=lambda kv: _layer_order(kv[0])))
            for operand in sorted(stat, key=lambda o: order.index(o) if o in order else len(order))
        }
    warned = [
        {"step": e["step"], "layer": e.get("layer"), "operand": e.get("operand")}
        for e in run.anomalies.records
        if e.get("kind") == "fp8_health"
    ]
    return {
        "underflow": out.get("underflow", {}),
        "saturated": out.get("saturated", {}),
        "warned": warned,
    }


def goodput_series(run: RunRecords) -> dict | Skipped:
    """Where the run's wall time went, from its first launch (keel/run_dir/goodput.py): the totals, and
    the spans over wall time, adjacent spans of one kind merged to the plot's resolution (1/1000 of the wall)."""
    found = account(run.run_dir)
    if found is None:
        return Skipped(
            "no timeline.jsonl with a launch's first step yet (runs before this version have none)"
        )
    resolution = found.wall_s / 1000
    spans: list[dict[str, Any]] = []
    for span in found.spans:
        last = spans[-1] if spans else None
        if (
            last
            and last["what"] == span.what
            and span.start - (last["start"] + last["seconds"]) <= resolution
        ):
            last["seconds"] = max(last["seconds"], span.start + span.seconds - last["start"])
        elif span.seconds >= resolution or span.what != "productive":
            spans.append({"start": span.start, "seconds": span.seconds, "what": span.what})
    return {
        "fraction": found.fraction,
        "wall_s": found.wall_s,
        "productive_s": found.productive_s,
        "launches": found.launches,
        "lost": found.lost,
        "spans": spans,
    }


# plot name → how to build its series, in the order report.md shows them
SERIES = {
    "loss": loss_series,
    "lr": lr_series,
    "grad_norm": grad_norm_series,
    "loss_scale": loss_scale_series,
    "throughput": throughput_series,
    "stragglers": stragglers_series,
    "experts": experts_series,
    "fp8": fp8_series,
    "goodput": goodput_series,
}


def all_series(run: RunRecords) -> dict[str, dict | Skipped]:
    return {name: build(run) for name, build in SERIES.items()}
