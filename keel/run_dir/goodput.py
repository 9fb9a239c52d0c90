"""Goodput: productive step time ÷ wall time from the run's first launch to its end, across restarts and requeues,
and where the rest went.

Read off the run dir: each launch's start-up phases and end (timeline.jsonl, keel/training/observe/timeline.py),
every step's time and its checks, evaluation and checkpoint stall (metrics.jsonl, each step stamped with its end),
the steps trained and then thrown away (metrics.discarded.jsonl: by a restart, whose process ended before a
checkpoint kept them, or by a rollback), rollbacks' reloads (anomalies.jsonl) and a preflight run before training
(preflight.json). Productive: the kept steps that were not skipped. Whatever no record explains (the loop's own
work, logging, a requeued job waiting in the queue is `between launches`) is `other`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from keel.run_dir import RunDir

# where wall time that is not a productive step goes, in the order summary.md and `keel report` show it
LOSSES = (
    "start-up",
    "restore",
    "steps re-done after a failure",
    "rollbacks",
    "skipped steps",
    "checkpoint stalls",
    "evaluation",
    "checks",
    "preflight",
    "between launches",
    "other",
)


@dataclass
class Span:
    """A stretch of wall time (seconds since the run's first launch) and what it went to."""

    start: float
    seconds: float
    what: str  # "productive" or one of LOSSES


@dataclass
class Goodput:
    wall_s: float
    productive_s: float
    lost: dict[str, float]  # LOSSES -> seconds
    launches: int
    spans: list[Span] = field(default_factory=list)  # for `keel report`'s timeline

    @property
    def fraction(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def line(self) -> str:
        """One line for summary.md: the fraction, then each loss that took time."""
        lost = ", ".join(f"{k} {v:.1f} s" for k, v in self.lost.items() if v >= 0.05)
        return (
            f"{self.fraction:.1%} of {self.wall_s:.1f} s wall ({self.productive_s:.1f} s of productive steps, "
            f"{self.launches} launch{'es' if self.launches != 1 else ''}); lost: {lost or 'nothing'}"
        )


def account(run_dir: Path) -> Goodput | None:
    """The run's goodput, or None before its first step."""
    layout = RunDir(run_dir)
    timeline = read_timeline(run_dir)
    starts = [r for r in timeline if r.get("event") == "start"]
    if not starts:
        return None
    ends = [r for r in timeline if r.get("event") == "end"]
    kept = _lines(layout.metrics)
    discarded = _lines(layout.metrics_discarded)
    steps = kept + discarded
    lost = dict.fromkeys(LOSSES, 0.0)
    spans: list[Span] = []
    # launches: a start's own beginning is its job's launch when that came after the previous launch ended (a
    # requeue, a new `keel train`), else its process start (an elastic restart inherits the first launch's time)
    previous_end, begin = None, None
    for start in sorted(starts, key=lambda r: r["process_started"]):
        launched = start.get("launched_at")
        fresh = launched is not None and (previous_end is None or launched > previous_end)
        own = launched if fresh else start["process_started"]
        begin = own if begin is None else begin
        if previous_end is not None and own > previous_end:
            lost["between launches"] += own - previous_end
            spans.append(Span(previous_end, own - previous_end, "between launches"))
        restore = start["phases"].get("restore", 0.0)
        setup = max(0.0, start["first_step_at"] - own - restore)
        lost["start-up"] += setup
        lost["restore"] += restore
        spans.append(Span(own, setup + restore, "start-up"))
        previous_end = _last_activity(start, starts, ends, steps)
    preflight = _preflight(layout.preflight)
    if preflight is not None and preflight[0] <= begin:
        lost["preflight"] = preflight[1]
        spans.append(Span(preflight[0], preflight[1], "preflight"))
        begin = preflight[0]
    end = max(
        [previous_end or begin]
        + [r["time"] for r in ends]
        + [r["time"] for r in steps if "time" in r]
    )
    productive = 0.0
    for record in kept:
        seconds = record.get("step_time_s", 0.0)
        what = "skipped steps" if record.get("skipped") else "productive"
        productive += seconds if what == "productive" else 0.0
        lost["skipped steps"] += seconds if what != "productive" else 0.0
        _step_spans(spans, record, what)
    for record in discarded:
        what = (
            "rollbacks"
            if record.get("discarded_by") == "rollback"
            else "steps re-done after a failure"
        )
        lost[what] += record.get("step_time_s", 0.0)
        _step_spans(spans, record, what)
    for record in steps:
        lost["checkpoint stalls"] += record.get("save_time_s", 0.0)
        lost["evaluation"] += record.get("eval_time_s", 0.0)
        lost["checks"] += record.get("check_time_s", 0.0)
    lost["rollbacks"] += sum(
        e.get("seconds", 0.0) for e in _lines(layout.anomalies) if e.get("kind") == "rollback"
    )
    wall = max(0.0, end - begin)
    lost["other"] = max(0.0, wall - productive - sum(lost.values()))
    for span in spans:
        span.start -= begin
    return Goodput(wall, productive, lost, len(starts), sorted(spans, key=lambda s: s.start))


def _last_activity(start: dict, starts: list[dict], ends: list[dict], steps: list[dict]) -> float:
    """When the process that wrote `start` was last seen: its end record, else its last step (a killed process
    writes no end), else its start record."""
    later = [
        s["process_started"] for s in starts if s["process_started"] > start["process_started"]
    ]
    until = min(later) if later else float("inf")
    seen = [start["time"]]
    seen += [r["time"] for r in ends if start["time"] <= r["time"] < until]
    seen += [r["time"] for r in steps if "time" in r and start["time"] <= r["time"] < until]
    return max(seen)


def _step_spans(spans: list[Span], record: dict, what: str) -> None:
    """A step's own time, ending at its `time`; the checkpoint save before it (a record carries the stall of
    the save after the previous step); its checks and evaluation after it."""
    if "time" not in record:
        return
    end, step = record["time"], record.get("step_time_s", 0.0)
    save = record.get("save_time_s", 0.0)
    parts = [
        (end - step - save, save, "checkpoint stalls"),
        (end - step, step, what),
        (end, record.get("check_time_s", 0.0), "checks"),
        (end + record.get("check_time_s", 0.0), record.get("eval_time_s", 0.0), "evaluation"),
    ]
    spans.extend(Span(at, seconds, name) for at, seconds, name in parts if seconds > 0)


def read_timeline(run_dir: Path) -> list[dict]:
    """timeline.jsonl's records (keel/training/observe/timeline.py writes them), a line being written left out."""
    return _lines(RunDir(run_dir).timeline)


def _lines(path: Path) -> list[dict]:
    """A JSON-lines file of a run that may still be writing it: a line cut short is left out."""
    if not path.is_file():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in found if isinstance(r, dict)]


def _preflight(path: Path) -> tuple[float, float] | None:
    """(start, seconds) of the preflight that wrote `path`, which ended when the file was written."""
    if not path.is_file():
        return None
    try:
        seconds = float(json.loads(path.read_text()).get("elapsed_s", 0.0))
    except (ValueError, AttributeError):
        return None
    return path.stat().st_mtime - seconds, seconds
