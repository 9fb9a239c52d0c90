"""A token id outside the vocabulary at the sample: every rank stops at that step with the same line, exit 2.

The pre-launch check (keel/data/token_check.py) reads the whole index but only a sample of the ids, so an id it
did not read can still reach a step. The embedding would then fail with `IndexError: index out of range in self`
on the one rank holding it (or, under tensor parallelism, silently read a zero row), and its peers would wait in
the next collective. Instead the rank that sees it runs the step on stand-in ids (its update is vetoed like every
stop) and its stop travels in the step's existing agreement (keel/training/step_gate.py `agree`): the agreed
decision carries the exit code and the lowest bad global sample index, from which every rank rebuilds the same
line (file, token offset, sequence, document, sample) out of the shared token files.
"""

from __future__ import annotations

import numpy as np
import torch

from keel.data.bad_ids import bad_id_line
from keel.data.samples import step_sample_indices
from keel.data.token_check import stand_in
from keel.run_dir import ExitCode
from keel.training.guards.base import Action, Decision

_ADVICE = (
    "the file changed or is corrupt where the pre-launch sample did not look; fix or regenerate it"
)


def check_step_batch(
    micro_batches: list[torch.Tensor],
    row: int | None,
    vocab_size: int,
    start: int,
    size: int,
    micro_batch: int,
    dp_rank: int,
    dp_size: int,
) -> tuple[list[torch.Tensor], Decision | None]:
    """This rank's batch for samples [start, start + size), whose first row holding an id outside the vocabulary is
    `row` (`first_bad_row`, run by the prefetch worker): unchanged and None when clean, else the batch on stand-in
    ids and the data stop naming that row's global sample."""
    if row is None:
        return micro_batches, None
    sample = step_sample_indices(start, size, micro_batch, dp_rank, dp_size)[row]
    stop = Decision(
        Action.STOP,
        reason=f"global sample {sample} holds a token id outside the vocabulary",
        exit_code=ExitCode.BAD_DATA,
        sample=sample,
    )
    return stand_in(micro_batches, vocab_size), stop


def with_data_stop(decision: Decision, stop: Decision | None) -> Decision:
    """The guards' decision, overruled by this rank's data stop when it has one."""
    return decision if stop is None else Decision.most_severe([stop, decision])


def data_stop_line(samples, order, sample: int, step: int) -> str:
    """The line every rank prints for the agreed bad global `sample`: read from the token files every rank opens,
    so ranks that never held the sample name it the same way."""
    sample_id = order.sample_ids([sample])[0]
    dataset, begin = samples.origin(sample_id)
    vocab = samples.vocab_size
    where = f", train sample {sample_id} (global sample {sample}), step {step}"
    window = samples.window(sample_id)
    bad = np.flatnonzero((window < 0) | (window >= vocab))
    if not bad.size:  # the file changed again since the rank read it
        return (
            f"{dataset.prefix}.bin: train sample {sample_id} (global sample {sample}, tokens from {begin}) held a "
            f"token id outside the vocabulary [0, {vocab}) at step {step}; {_ADVICE}"
        )
    return bad_id_line(dataset, begin + int(bad[0]), vocab, _ADVICE, where)


def named_stop(decision: Decision, samples, order, step: int) -> Decision:
    """The agreed data stop with its line (built on every rank from the agreed sample)."""
    return Decision(
        Action.STOP,
        reason=data_stop_line(samples, order, decision.sample, step),
        exit_code=decision.exit_code or ExitCode.BAD_DATA,
        sample=decision.sample,
    )
