"""What guards share: the decision they return, the step record they read, and the anomalies log they write.

Guards decide, the trainer acts. A decision is made from globally reduced values (the loss averaged over
data-parallel ranks, the global gradient norm), so every rank reaches the same one without talking; where a
guard needs a collective it reduces the decision itself, and says so.
"""

from __future__ import annotations

import enum
import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class Action(enum.IntEnum):
    """Ordered by severity: when guards disagree, the most severe wins."""

    STEP = 0
    SKIP = 1
    ROLLBACK = 2
    STOP = 3


@dataclass
class Decision:
    action: Action = Action.STEP
    reason: str = ""
    exit_code: int = 0  # for STOP
    restore: bool = False  # ROLLBACK to repair state (e.g. a corrupted replica), without the spike LR cut
    # STOP on bad data: the global sample index holding ids outside the vocabulary (every rank names it the same)
    sample: int | None = None
    rewind_data: bool = False  # ROLLBACK with the data cursor rewound to the checkpoint's (the samples were innocent)
    to: str | None = None  # ROLLBACK: the checkpoint every rank already agreed to return to (None: choose it then)

    @staticmethod
    def most_severe(decisions: list[Decision]) -> Decision:
        return max(decisions, key=lambda d: d.action, default=Decision())


@dataclass
class StepStats:
    """One optimizer step as the guards see it (all values already reduced across ranks)."""

    step: int  # 1-based index of the step being decided
    loss: float
    grad_norm: float | None
    loss_scale: float | None = None
    sample_range: tuple[int, int] = (0, 0)  # global sample indices [start, end) of this step's batch
    extra: dict[str, Any] = field(default_factory=dict)


class AnomalyLog:
    """`<run_dir>/anomalies.jsonl`: one JSON object per event, each with a `kind`; written by rank 0 only
    unless `all_ranks` (events only one rank can see, e.g. a hang on that rank)."""

    def __init__(self, run_dir: Path, rank: int):
        self.path = Path(run_dir) / "anomalies.jsonl"
        self.rank = rank
        self.events: list[dict[str, Any]] = []  # this process's events, for the end-of-run summary

    def record(self, kind: str, step: int, all_ranks: bool = False, **fields: Any) -> dict[str, Any]:
        event = {"kind": kind, "step": step, "time": time.time(), "rank": self.rank, "host": socket.gethostname(),
                 **fields}
        self.events.append(event)
        if self.rank == 0 or all_ranks:
            with open(self.path, "a") as f:  # one short line per write: appends of whole lines do not interleave
                f.write(json.dumps(event, default=str) + "\n")
        return event


def read_anomalies(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "anomalies.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
