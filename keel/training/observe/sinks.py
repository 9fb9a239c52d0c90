"""Dashboards: every metrics record to TensorBoard and/or Weights & Biases, behind one `Sinks.log`.

metrics.jsonl and the dashboards carry the same numbers (the model monitor's scalars included, keel/training/
monitor.py); each sink is optional and checked for at start-up on every rank.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import uuid
from pathlib import Path
from typing import Any

from keel.config import ConfigError, StabilityConfig
from keel.run_dir import RunDir, write_atomic

# -- sinks ------------------------------------------------------------------------------------------------------
# Metrics-record keys whose dashboard tag is not simply `train/<key>`; keys holding a "/" are tags already.
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "tokens_per_s": "train/tokens_per_s",
    "skipped": "train/skipped",
    "val_loss": "val/loss",
}
NOT_LOGGED = ("step",)  # the x axis, not a series


def tag_for(key: str) -> str:
    return TAGS.get(key, key if "/" in key else f"train/{key}")


def dashboard_scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Tag → value for every finite number in `record`; nested dicts become paths (guards={"spike": 2} →
    guards/spike). None, strings and non-finite values are left out: a dashboard plots numbers only."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(dashboard_scalars(value, prefix=f"{name}/"))
        elif key not in NOT_LOGGED and isinstance(value, numbers.Real) and math.isfinite(value):
            out[tag_for(name)] = float(value)
    return out


def check_sinks(stability: StabilityConfig) -> None:
    """Raise a one-line ConfigError if a configured sink's package is missing.

    Called by `Sinks` on every rank (not only the one that writes), so all ranks stop together at start-up
    instead of rank 0 failing while the others wait in a collective; a launcher may call it before any rank starts.
    """
    if stability.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "stability.tensorboard: true but the tensorboard package is not installed; "
            "pip install tensorboard, or set stability.tensorboard=false"
        )
    if stability.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "stability.wandb: true but the wandb package is not installed; "
            "pip install wandb, or set stability.wandb=false"
        )


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id, kept in `<run_dir>/wandb_id.txt` so a restarted job continues its run, not a new one."""
    path = RunDir(run_dir).wandb_id
    if path.is_file():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:16]
    write_atomic(path, run_id.encode())
    return run_id


class Sinks:
    """TensorBoard (`<run_dir>/tensorboard/`) and W&B behind one `log(step, record)`; each optional.

    Only the rank given `enabled` writes. On resume, TensorBoard is told to drop the old events past
    `resumed_step` (those steps are trained again), as metrics.jsonl does. W&B cannot rewrite history: it keeps
    the first values and warns about (and drops) steps logged again below its last one.
    """

    def __init__(
        self,
        run_dir: str | Path,
        stability: StabilityConfig,
        run_config: dict[str, Any] | None = None,
        enabled: bool = True,
        resumed_step: int = 0,
    ) -> None:
        check_sinks(stability)
        self._tensorboard = None
        self._wandb = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        if stability.tensorboard:
            # optional sink (check_sinks), ~1 s to import
            from torch.utils.tensorboard import (
                SummaryWriter,
            )

            self._tensorboard = SummaryWriter(
                str(RunDir(run_dir).tensorboard),
                purge_step=resumed_step + 1 if resumed_step > 0 else None,
            )
        if stability.wandb:
            import wandb  # optional dependency (the wandb extra)

            self._wandb = wandb.init(
                project=stability.wandb_project,
                dir=str(run_dir),
                mode=stability.wandb_mode,
                config=run_config or {},
                resume="allow",
                id=wandb_run_id(run_dir),
            )

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        """Write one metrics record (or any dict of scalars) at `step`."""
        if self._tensorboard is None and self._wandb is None:
            return
        tagged = dashboard_scalars(scalars)
        if self._tensorboard is not None:
            for tag, value in tagged.items():
                self._tensorboard.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(tagged, step=step)

    def rewind(self, step: int) -> None:
        """Steps after `step` will be trained again (a rollback): TensorBoard drops its events past `step`, as
        `MetricsWriter.rewind` moves those records aside. W&B keeps its first values (see above)."""
        if self._tensorboard is not None:
            from tensorboard.compat.proto.event_pb2 import (
                Event,
                SessionLog,
            )  # optional, as in __init__

            # What SummaryWriter(purge_step=...) writes, but into the open file: read after the events it purges.
            restart = Event(step=step + 1, session_log=SessionLog(status=SessionLog.START))
            self._tensorboard.file_writer.add_event(restart)

    def flush(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
