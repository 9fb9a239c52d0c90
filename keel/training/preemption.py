"""Preemption: on SIGUSR1 or SIGTERM every rank finishes its step, a checkpoint is saved, and the process
exits with `EXIT_PREEMPTED`, which the SLURM script answers by requeueing the job.

The signal may reach only some ranks (or reach them at different times), so the flag is agreed on with one
scalar all-reduce at the end of each step: every rank stops after the same step.
"""

from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

log = logging.getLogger("keel")

EXIT_PREEMPTED = 5
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionHandler:
    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {}
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            log.warning("received %s: stopping after this step with a checkpoint", signal.Signals(signum).name)
        self.received = signum

    def should_stop(self) -> bool:
        """Collective: True on every rank if any rank was signalled."""
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
