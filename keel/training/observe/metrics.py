"""Per-step metrics: one JSON object per optimizer step in `<run_dir>/metrics.jsonl`, and a compact stdout line.

Only rank 0 writes. On resume, records past the resumed step (steps that will be trained again) are moved to
`metrics.discarded.jsonl` rather than deleted, so the main file keeps exactly one record per step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from keel.run_dir import RunDir
from keel.training.observe.progress import Progress

FIELDS = ("step", "loss", "lr", "grad_norm", "loss_scale", "tokens", "tokens_per_s", "skipped")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsWriter:
    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        resumed_step: int,
        log_interval: int,
        total_steps: int,
        progress: Progress | None = None,
    ):
        """`progress`: the step line's MFU and ETA (keel/training/observe/progress.py); None leaves them out."""
        self.enabled = enabled
        self.progress = progress
        self.log_interval = max(1, log_interval)
        self.total_steps = total_steps
        self.path = RunDir(run_dir).metrics
        self._file = None
        if enabled:
            self.rewind(resumed_step, "restart")
            self._file = open(self.path, "a", buffering=1)

    def rewind(self, resumed_step: int, why: str) -> None:
        """Move records past `resumed_step` (steps about to be trained again) to metrics.discarded.jsonl, each
        marked with `why` (restart: the process that trained them ended before a checkpoint kept them;
        rollback: a guard returned to an earlier checkpoint)."""
        if not self.enabled:
            return
        records = read_metrics(self.path)
        keep = [r for r in records if r.get("step", 0) <= resumed_step]
        if len(keep) == len(records):
            return
        dropped = [r for r in records if r.get("step", 0) > resumed_step]
        with open(RunDir(self.path.parent).metrics_discarded, "a") as f:
            f.writelines(json.dumps({**r, "discarded_by": why}) + "\n" for r in dropped)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        if self._file is not None:
            self._file.close()
        os.replace(tmp, self.path)
        if self._file is not None:
            self._file = open(self.path, "a", buffering=1)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        # every step: the ETA's window
        suffix = self.progress.describe(record) if self.progress is not None else ""
        step = record["step"]
        if step % self.log_interval == 0 or step == self.total_steps or "val_loss" in record:
            line = format_line(record, self.total_steps) + (f" | {suffix}" if suffix else "")
            # one write with its newline: every rank shares the launcher's pipe, and print's separate
            # write of "\n" lets another rank's line land between them (unbuffered stdout)
            print(line + "\n", end="", flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def format_line(r: dict[str, Any], total_steps: int) -> str:
    parts = [
        f"step {r['step']:>6}/{total_steps}",
        f"loss {r['loss']:.4f}",
        f"lr {r['lr']:.2e}",
        f"gnorm {r['grad_norm']:.3f}" if r.get("grad_norm") is not None else "gnorm -",
        f"{r['tokens_per_s'] / 1e3:.1f}k tok/s",
    ]
    if r.get("loss_scale") is not None:
        parts.append(f"scale {r['loss_scale']:g}")
    if r.get("skipped"):
        parts.append("SKIPPED")
    if "val_loss" in r:
        parts.append(f"val {r['val_loss']:.4f}")
    return " | ".join(parts)
