"""Every torch internal Keel reads or patches, in one place (see deepspeed_internals/ for why this exists).

`check_torch` probes each one, so an upgrade that removes one fails with one line naming it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
from collections.abc import Iterator

import torch


class TorchInternalsError(RuntimeError):
    """A torch internal Keel relies on is gone: the installed torch is outside the verified range."""


@functools.cache  # finding a class's source parses its module (~0.1 s); every engine build probes
def _scheduler_source() -> str:
    return inspect.getsource(torch.optim.lr_scheduler.LRScheduler)


def _names_groups_by_hash() -> bool:
    c10d = torch.distributed.distributed_c10d
    return hasattr(c10d, "_hash_ranks_to_str") and "_hash_ranks_to_str(" in inspect.getsource(
        c10d._process_group_name
    )


def _has_lse_attention() -> bool:
    names = (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    )
    return all(hasattr(torch.ops.aten, name) for name in names)


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
    (
        "torch.distributed.distributed_c10d._get_default_store",
        "the store the process group was initialized with",
        lambda: hasattr(torch.distributed.distributed_c10d, "_get_default_store"),
    ),
    (
        "torch.distributed.distributed_c10d._hash_ranks_to_str",
        "a group name every member computes alike under use_local_synchronization",
        lambda: _names_groups_by_hash(),
    ),
    (
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(_backward)",
        "an SDPA call that returns the log-sum-exp, and a backward that takes the merged output and log-sum-exp "
        "(context parallel's ring attention merges blocks by it)",
        lambda: _has_lse_attention(),
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


def default_store() -> torch.distributed.Store:
    """The key-value store the default process group met in (torchrun's, or init_process_group's TCPStore):
    where one rank can tell the others something without a collective, so they wait on it with no process-group
    timeout (a long conversion on rank 0, say). Missing public API: the store behind `init_process_group`."""
    return torch.distributed.distributed_c10d._get_default_store()


@contextlib.contextmanager
def groups_named_by_their_ranks(purpose: str = "keel") -> Iterator[None]:
    """Inside, a group created with `use_local_synchronization=True` is named by its ranks alone.

    torch names such a group by its ranks salted with how many groups this process holds (`_hash_ranks_to_str`),
    and gloo meets its members in the store under that name. Ranks that created different numbers of groups before
    (a pair another rank is not in: preflight's links, DeepSpeed's tied-embedding pair) then compute different
    names for one group and wait for each other forever (pytorch/pytorch#173608; upstream salts with a count every
    rank shares instead, #189073). Missing public API: a name, or a salt, for `new_group`. Keel creates a rank set
    once per process (keel/parallel/process_groups.py), so the ranks alone are unique; a second group of the same
    ranks for another `purpose` (a background thread's own) is named by both."""
    c10d = torch.distributed.distributed_c10d
    if not _names_groups_by_hash():
        raise TorchInternalsError(
            f"torch {torch.__version__} no longer names locally synchronized groups through "
            "_hash_ranks_to_str; install a torch in the range setup.py pins"
        )
    original = c10d._hash_ranks_to_str
    c10d._hash_ranks_to_str = lambda ranks: hashlib.sha1(
        (f"{purpose}:" + "_".join(map(str, ranks))).encode(), usedforsecurity=False
    ).hexdigest()
    try:
        yield
    finally:
        c10d._hash_ranks_to_str = original


def cpu_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel on [b, heads, s, d] (equal head counts): (output, log-sum-exp [b, heads, s] fp32).
    `mask`: additive, in q's dtype, broadcastable to [b, heads, s_q, s_k]. A query row with every key masked comes
    back with output 0 and log-sum-exp 0 (not -inf): the caller marks such rows."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask
    )


def cpu_attention_with_lse_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the attention's merged `out` and `lse` over every block (flash
    backward recomputes the probabilities as exp(q·kᵀ - lse), so a block's share comes out exact)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask
    )
