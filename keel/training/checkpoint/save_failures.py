"""What a run does after a checkpoint save that every rank agreed failed (`checkpoint.on_save_error`).

By then the save is already discarded on every rank (keel/training/checkpoint/store.py `finish_save`): the previous
checkpoint is intact and `latest` still names it. `continue` (the default) warns, records the failure and tries
again at the next interval — a full disk is often freed by whoever watches it, and the steps since the previous
checkpoint are all that is at risk. `stop` ends the run at once with exit code 8. A run whose last save failed
(the final step, `train.exit_after`, a preemption) exits 8 either way: it would otherwise end with its newest
steps lost while reporting success.
"""

from __future__ import annotations

import logging

from keel.run_dir import AnomalyLog, ExitCode
from keel.training.checkpoint.store import SaveOutcome

log = logging.getLogger("keel")

__all__ = ["after_failed_save"]


def after_failed_save(
    outcome: SaveOutcome,
    policy: str,
    final: bool,
    step: int,
    anomalies: AnomalyLog,
    rank: int,
    previous: str | None,
) -> str:
    """Every rank alike (they share the verdict): "" to go on, else the one-line reason to stop with exit 8.
    `previous`: the newest complete checkpoint, which stays latest (None: the run has none yet)."""
    stop = final or policy == "stop"
    anomalies.record(
        "checkpoint_save_failed",
        step,
        checkpoint=outcome.tag,
        error=outcome.error,
        action="stop" if stop else "continue",
        latest=previous,
    )
    kept = (
        f"the previous checkpoint {previous} is intact and stays latest"
        if previous
        else "the run has no complete checkpoint yet"
    )
    if not stop:
        if rank == 0:
            log.warning(
                "step %d: checkpoint %s not saved (%s); %s; the next save is tried at the next interval "
                "(checkpoint.on_save_error: continue)",
                step,
                outcome.tag,
                outcome.error,
                kept,
            )
        return ""
    why = "the run's final save" if final else "checkpoint.on_save_error: stop"
    return (
        f"checkpoint {outcome.tag} could not be saved ({outcome.error}); {why}: stopping with exit code "
        f"{ExitCode.SAVE_FAILED}; {kept}"
    )
