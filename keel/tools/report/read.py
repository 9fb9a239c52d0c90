"""What `keel report` reads from a run dir, tolerant of a run still writing it.

A live run appends whole lines, so the only damage a reader can meet is a last line cut short mid-write: it is
left out and counted (report.md says so). A bad line elsewhere is not a live-run artefact; it is left out too and
counted separately, so the report still draws what is there and says what it could not read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from keel.config import ConfigError
from keel.run_dir import RunDir


@dataclass
class JsonLines:
    records: list[dict[str, Any]] = field(default_factory=list)
    partial_last_line: bool = False  # a last line cut short (a run still writing it): left out
    unreadable: int = 0  # other lines that are not JSON objects: left out


def read_jsonl(path: Path) -> JsonLines:
    """Every JSON object line of `path` (none if it does not exist)."""
    out = JsonLines()
    if not path.is_file():
        return out
    data = path.read_bytes()
    lines = data.decode("utf-8", errors="replace").split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            out.records.append(record)
        elif i == last and not data.endswith(b"\n"):
            out.partial_last_line = True
        else:
            out.unreadable += 1
    return out


@dataclass
class RunRecords:
    """One run dir as the report sees it."""

    run_dir: Path
    metrics: JsonLines  # metrics.jsonl: one record per step of the run as it stands
    discarded: JsonLines  # metrics.discarded.jsonl: steps trained, then rolled back or re-trained after a resume
    anomalies: JsonLines  # anomalies.jsonl: guard events, rollbacks, resumes
    config: dict[str, Any]  # config.yaml, resolved ({} if absent)

    @property
    def total_steps(self) -> int | None:
        steps = self.config.get("train", {}).get("steps")
        return steps if isinstance(steps, int) else None

    def left_out(self) -> dict[str, str]:
        """File → what was left out of it, for report.md."""
        notes = {}
        layout = RunDir(self.run_dir)
        for path, lines in (
            (layout.metrics, self.metrics),
            (layout.metrics_discarded, self.discarded),
            (layout.anomalies, self.anomalies),
        ):
            parts = (
                ["a partial last line (still being written)"] if lines.partial_last_line else []
            ) + ([f"{lines.unreadable} unreadable line(s)"] if lines.unreadable else [])
            if parts:
                notes[path.name] = " and ".join(parts)
        return notes


def read_run(run_dir: Path) -> RunRecords:
    """The run dir's records; a directory that is not a Keel run dir is a one-line ConfigError."""
    if not run_dir.is_dir():
        raise ConfigError(f"keel report: {run_dir} is not a directory")
    layout = RunDir(run_dir)
    files = (layout.metrics, layout.config, layout.anomalies)
    if not any(path.is_file() for path in files):
        names = ", ".join(path.name for path in files)
        raise ConfigError(f"keel report: {run_dir} is not a keel run dir (none of {names} in it)")
    config: dict[str, Any] = {}
    if layout.config.is_file():
        try:
            loaded = yaml.safe_load(layout.config.read_text())
            config = loaded if isinstance(loaded, dict) else {}
        except yaml.YAMLError:
            config = {}
    return RunRecords(
        run_dir,
        read_jsonl(layout.metrics),
        read_jsonl(layout.metrics_discarded),
        read_jsonl(layout.anomalies),
        config,
    )
