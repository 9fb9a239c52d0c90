"""Preemption: on SIGUSR1 or SIGTERM every rank finishes its step, a checkpoint is saved, and the process
exits with `ExitCode.PREEMPTED`, which the SLURM script answers by requeueing the job.

The signal may reach only some ranks (or reach them at different times), so the flag rides on the step's one
agreement (keel/training/step_gate.py `agree`): every rank stops after the same step.
"""

from __future__ import annotations

import logging
import signal

log = logging.getLogger("keel")

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionHandler:
    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {}
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            log.warning(
                "received %s: stopping after this step with a checkpoint",
                signal.Signals(signum).name,
            )
        self.received = signum

    def signalled(self) -> bool:
        """This rank's flag (not agreed: the step gate agrees it with the step's decision)."""
        return self.received is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
