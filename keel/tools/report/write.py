"""`keel report RUN_DIR [--out DIR]`: a run's plots, `report.md` and `series.json`, written atomically.

Everything goes into a fresh directory beside DIR, which then replaces DIR in two renames: a reader (or a report
re-made while the run goes on) never sees half a report. Works on a live run: it reads whatever is there.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.config import ConfigError
from keel.run_dir import RunDir
from keel.tools.report.read import RunRecords, read_run
from keel.tools.report.series import Skipped, all_series

INSTALL_HINT = "keel report draws with matplotlib, which is not installed: pip install 'keel[plot]'"
# report.md's table keeps the last this many events (anomalies.jsonl has them all)
ANOMALY_ROWS = 200


@dataclass
class Report:
    out_dir: Path
    drawn: list[str]  # plot names, each <name>.png
    skipped: dict[str, str]  # plot name → why it has no data
    left_out: dict[str, str]  # file → lines left out (a live run's partial last line)


def write_report(run_dir: Path, out_dir: Path | None = None) -> Report:
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(INSTALL_HINT)
    # imports matplotlib, an optional dependency: checked just above
    from keel.tools.report.plots import (
        DRAW,
    )

    run_dir = run_dir.expanduser().resolve()
    out_dir = (out_dir or RunDir(run_dir).report).expanduser().resolve()
    run = read_run(run_dir)
    _check_out(out_dir, run_dir)
    series = all_series(run)
    drawn = [name for name, s in series.items() if not isinstance(s, Skipped)]
    skipped = {name: s.reason for name, s in series.items() if isinstance(s, Skipped)}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        for name in drawn:
            (staging / f"{name}.png").write_bytes(DRAW[name](series[name]))
        (staging / "series.json").write_text(
            json.dumps(
                {
                    "run_dir": str(run_dir),
                    "plots": {n: series[n] for n in drawn},
                    "skipped": skipped,
                    "left_out": run.left_out(),
                },
                indent=1,
                allow_nan=False,
            )
            + "\n"
        )
        (staging / "report.md").write_text(markdown(run, series, drawn, skipped))
        _publish(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Report(out_dir, drawn, skipped, run.left_out())


def _check_out(out_dir: Path, run_dir: Path) -> None:
    """DIR is replaced as a whole: only a previous report (or nothing, or an empty directory) may be there."""
    if out_dir == run_dir or out_dir in run_dir.parents:
        raise ConfigError(
            f"keel report: --out {out_dir} would replace the run dir; use a directory of its own"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"keel report: --out {out_dir} is a file")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "report.md").is_file():
        raise ConfigError(
            f"keel report: --out {out_dir} holds files but no report.md; it is replaced as a whole, "
            "so give a new or empty directory (or a previous report's)"
        )


def _publish(staging: Path, out_dir: Path) -> None:
    """Replace `out_dir` by `staging`: the old report moves aside first and is removed once the new one is in."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old{os.getpid()}")
        os.replace(out_dir, old)
    os.replace(staging, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- report.md ---------------------------------------------------------------------------------------------------
TITLES = {
    "loss": "Loss",
    "lr": "Learning rate",
    "grad_norm": "Gradient norm",
    "loss_scale": "fp16 loss scale",
    "throughput": "Throughput and step time",
    "stragglers": "Slowest and fastest rank",
    "experts": "MoE expert load",
    "fp8": "FP8 health",
    "goodput": "Goodput: where the wall time went",
}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _summary(run: RunRecords, series: dict[str, Any]) -> list[str]:
    records = run.metrics.records
    total = run.total_steps
    if not records:
        return ["- no step recorded yet"]
    last = records[-1]
    state = (
        "finished"
        if total is not None and last.get("step") == total
        else (f"at step {last.get('step')} of {total} (still running, or stopped: see summary.md)")
    )
    lines = [f"- status: {state}"]
    finite = [r for r in records if isinstance(r.get("loss"), float) and math.isfinite(r["loss"])]
    kept = [
        r for r in finite if not r.get("skipped")
    ] or finite  # the applied steps' (all skipped: every one's)
    if kept:
        lowest = min(kept, key=lambda r: r["loss"])
        lines.append(
            f"- training loss: {kept[0]['loss']:.4f} at step {kept[0]['step']} → {kept[-1]['loss']:.4f} "
            f"at step {kept[-1]['step']} (lowest {lowest['loss']:.4f} at step {lowest['step']})"
        )
    vals = [r for r in records if isinstance(r.get("val_loss"), float)]
    if vals:
        lines.append(
            "- validation loss: "
            + ", ".join(f"{r['val_loss']:.4f} (step {r['step']})" for r in vals[-6:])
        )
    speeds = [r["tokens_per_s"] for r in records if isinstance(r.get("tokens_per_s"), float)]
    if speeds:
        lines.append(
            f"- throughput: mean {sum(speeds) / len(speeds):,.0f} tokens/s over {len(speeds)} steps; "
            f"{last.get('tokens', 0):,} tokens"
        )
    loss = series["loss"]
    if not isinstance(loss, Skipped):
        skipped = loss["skipped"]
        lines.append(
            f"- skipped steps: {len(skipped)}"
            + (
                ": "
                + ", ".join(
                    f"{m['step']}{' (rolled back)' if m['rolled_back'] else ''}" for m in skipped
                )
                if skipped
                else ""
            )
        )
        lines.append(
            f"- rollbacks: {len(loss['rollbacks'])}"
            + (
                ": " + ", ".join(f"step {r['step']} → {r['to_step']}" for r in loss["rollbacks"])
                if loss["rollbacks"]
                else ""
            )
        )
        lines.append(
            f"- resumes: {len(loss['resumes'])}"
            + (": at step " + ", ".join(map(str, loss["resumes"])) if loss["resumes"] else "")
        )
    goodput = series.get("goodput")
    if goodput is not None and not isinstance(goodput, Skipped):
        lost = ", ".join(f"{k} {v:.1f} s" for k, v in goodput["lost"].items() if v >= 0.05)
        lines.append(
            f"- goodput: {goodput['fraction']:.1%} of {goodput['wall_s']:.1f} s wall; lost: {lost or 'nothing'}"
        )
    return lines


def _anomalies(run: RunRecords) -> list[str]:
    events = run.anomalies.records
    if not events:
        return ["none"]
    counts = Counter(e.get("kind", "?") for e in events)
    lines = [
        "Events by kind: " + ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items())),
        "",
        "| step | kind | rank | detail |",
        "|---:|---|---:|---|",
    ]
    shown = events[-ANOMALY_ROWS:]
    if len(events) > len(shown):
        lines.insert(
            1, f"(the last {len(shown)} of {len(events)}; every one is in anomalies.jsonl)"
        )
    for e in shown:
        detail = {k: v for k, v in e.items() if k not in ("kind", "step", "rank", "time", "host")}
        text = (
            "; ".join(f"{k}={_fmt(v)}" for k, v in detail.items())
            .replace("|", "\\|")
            .replace("\n", " ")
        )
        lines.append(
            f"| {e.get('step', '')} | {e.get('kind', '')} | {e.get('rank', '')} | {text[:300]} |"
        )
    return lines


def markdown(
    run: RunRecords, series: dict[str, Any], drawn: list[str], skipped: dict[str, str]
) -> str:
    lines = [
        f"# Keel run report: {run.run_dir.name}",
        "",
        f"Run dir `{run.run_dir}`, read at {time.strftime('%Y-%m-%d %H:%M:%S %Z')}.",
        "",
        "## Summary",
        "",
    ]
    lines += _summary(run, series)
    for name, what in run.left_out().items():
        lines.append(f"- left out of {name}: {what}")
    lines += ["", "## Plots", ""]
    for name in drawn:
        lines += [f"### {TITLES[name]}", "", f"![{name}]({name}.png)", ""]
    if skipped:
        lines += ["## Plots skipped", ""]
        lines += [f"- {TITLES[name]} (`{name}.png`): {reason}" for name, reason in skipped.items()]
        lines.append("")
    lines += ["## Anomalies", ""] + _anomalies(run)
    lines += ["", "The numbers drawn are in `series.json`."]
    return "\n".join(lines) + "\n"
