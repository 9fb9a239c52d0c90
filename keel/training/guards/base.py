"""What guards share: the decision they return and the step record they read (the anomaly log they write is
`keel.run_dir.AnomalyLog`).

Guards decide, the trainer acts. A decision is made from globally reduced values (the loss averaged over
data-parallel ranks, the global gradient norm), so every rank reaches the same one without talking; where a
guard needs a collective it reduces the decision itself, and says so.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
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
    # ROLLBACK to repair state (e.g. a corrupted replica), without the spike LR cut
    restore: bool = False
    # STOP on bad data: the global sample index holding ids outside the vocabulary (every rank names it the same)
    sample: int | None = None
    rewind_data: bool = False  # ROLLBACK with the data cursor rewound to the checkpoint's (the samples were innocent)
    # ROLLBACK: the checkpoint every rank already agreed to return to (None: choose it then)
    to: str | None = None

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
    sample_range: tuple[int, int] = (
        0,
        0,
    )  # global sample indices [start, end) of this step's batch
    extra: dict[str, Any] = field(default_factory=dict)
