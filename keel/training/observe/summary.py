"""The human-readable end-of-run summary (`<run_dir>/summary.md`): what the run did and what went wrong."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from keel.run_dir import RunDir, read_anomalies, write_atomic
from keel.run_dir.bad_nodes import BadNodesError, read_bad_nodes
from keel.run_dir.goodput import account
from keel.training.observe.metrics import read_metrics


def write_summary(run_dir: Path, finished: bool, exit_code: int, reason: str = "") -> Path:
    records = read_metrics(RunDir(run_dir).metrics)
    events = read_anomalies(run_dir)
    lines = ["# Keel run summary", "", f"- run dir: `{run_dir}`"]
    status = "finished" if finished else f"stopped early (exit code {exit_code})"
    lines.append(f"- status: {status}{': ' + reason if reason else ''}")
    if records:
        first, last = records[0], records[-1]
        lines.append(
            f"- steps: {last['step']} (loss {first['loss']:.4f} at step {first['step']} → "
            f"{last['loss']:.4f} at step {last['step']})"
        )
        vals = [r for r in records if "val_loss" in r]
        if vals:
            lines.append(
                f"- validation loss: {vals[-1]['val_loss']:.4f} at step {vals[-1]['step']}"
            )
        lines.append(f"- skipped steps: {sum(1 for r in records if r.get('skipped'))}")
        lines.append(f"- tokens: {last['tokens']:,}; last LR scale: {last.get('lr_scale', 1.0):g}")
    goodput = account(run_dir)
    if goodput is not None:
        lines.append(f"- goodput: {goodput.line()}")
    try:
        bad = read_bad_nodes(run_dir)
    except BadNodesError as err:
        lines.append(f"- bad nodes: {err}")
    else:
        if bad:
            named = ", ".join(f"{n.host} ({n.reason} at step {n.step})" for n in bad)
            lines.append(f"- bad nodes, left out of the next attempt (bad_nodes.json): {named}")
    counts = Counter(e["kind"] for e in events)
    lines += ["", "## Anomalies", ""]
    if not events:
        lines.append("none")
    for kind, count in sorted(counts.items()):
        lines.append(f"- {kind}: {count}")
    for event in events[-20:]:
        detail = (
            event.get("reason")
            or event.get("error")
            or event.get("parameter")
            or event.get("classification")
            or event.get("checkpoint")
            or ""
        )
        lines.append(f"  - step {event['step']} rank {event['rank']} {event['kind']}: {detail}")
    path = RunDir(run_dir).summary
    write_atomic(path, "\n".join(lines) + "\n")
    return path
