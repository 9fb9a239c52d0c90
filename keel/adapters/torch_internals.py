"""Every torch internal Keel reads or patches, in one place (see deepspeed_internals/ for why this exists).

`check_torch` probes each one, so an upgrade that removes one fails with one line naming it.
"""

from __future__ import annotations

import inspect

import torch


class TorchInternalsError(RuntimeError):
    """A torch internal Keel relies on is gone: the installed torch is outside the verified range."""


def _scheduler_source() -> str:
    return inspect.getsource(torch.optim.lr_scheduler.LRScheduler)


# (what, the public API that is missing, is it still there?)
INTERNALS = [
    (
        "LRScheduler._last_lr",
        "a setter for what get_last_lr() reports after an out-of-step LR change",
        lambda: "self._last_lr" in _scheduler_source(),
    ),
    (
        "optimizer.step._wrapped_by_lr_sched",
        "a way to wrap optimizer.step without the scheduler's call-order warning",
        lambda: "_wrapped_by_lr_sched" in _scheduler_source(),
    ),
]


def check_torch() -> None:
    for name, missing_api, present in INTERNALS:
        if not present():
            raise TorchInternalsError(
                f"torch {torch.__version__} has no `{name}`, which Keel uses for want of "
                f"{missing_api}; install a torch in the range setup.py pins"
            )


def set_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, lrs: list[float]) -> None:
    """Make `get_last_lr()` report `lrs` (LambdaLR keeps no public setter for `_last_lr`)."""
    scheduler._last_lr = list(lrs)


def keep_scheduler_mark(wrapper, wrapped) -> None:
    """torch's LR scheduler marks the `optimizer.step` it wrapped (`_wrapped_by_lr_sched`) and warns when the mark
    is missing; a wrapper around that step carries the mark on."""
    wrapper._wrapped_by_lr_sched = getattr(wrapped, "_wrapped_by_lr_sched", True)
