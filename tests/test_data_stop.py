"""The at-sample stop in one process (keel/training/data_stop.py, step_gate's agreement): the batch check names the
global sample, the agreement carries the stop's exit code and the lowest bad sample to every rank, and every
rank builds the same line from it."""

from pathlib import Path

import numpy as np
import pytest
import torch

from keel.data import (
    DataError,
    GlobalSampleOrder,
    IndexedDataset,
    IndexedDatasetWriter,
    PackedSamples,
    step_batch,
)
from keel.data.token_check import first_bad_row
from keel.parallel import comm
from keel.run_dir import ExitCode
from keel.training import step_gate
from keel.training.data_stop import check_step_batch, named_stop, with_data_stop
from keel.training.guards.base import Action, Decision

SEQ, GLOBAL, MICRO, DP = 16, 8, 2, 2


@pytest.fixture
def corrupt(tmp_path: Path) -> tuple[PackedSamples, GlobalSampleOrder, int, int]:
    """A token file whose id at one token was changed behind the writer's back to 1000 (the vocabulary's size);
    returns the train samples, their order, the bad token and the global sample (of step 2) that holds it."""
    with IndexedDatasetWriter(tmp_path / "d", 1000) as writer:
        for _ in range(20):
            writer.add_document(np.arange(100) % 1000)
    samples = PackedSamples(IndexedDataset(tmp_path / "d"), SEQ, "train", 0.1)
    order = GlobalSampleOrder(len(samples), seed=3)
    sample = GLOBAL + 5  # step 2, data-parallel rank 1's second sample
    token = order.sample_id(sample) * SEQ + 7
    tokens = np.fromfile(tmp_path / "d.bin", dtype=np.uint16)
    tokens[token] = 1000
    tokens.tofile(tmp_path / "d.bin")
    return PackedSamples(IndexedDataset(tmp_path / "d"), SEQ, "train", 0.1), order, token, sample


def test_the_batch_check_names_the_global_sample_and_stands_in(corrupt) -> None:
    samples, order, token, sample = corrupt
    for rank in range(DP):
        raw = step_batch(order, samples, GLOBAL, GLOBAL, MICRO, rank, DP, checked=False)
        batch, stop = check_step_batch(
            raw, first_bad_row(raw, 1000), 1000, GLOBAL, GLOBAL, MICRO, rank, DP
        )
        if rank == 0:
            assert stop is None and batch is raw
            continue
        assert (stop.action, stop.exit_code, stop.sample) == (
            Action.STOP,
            ExitCode.BAD_DATA,
            sample,
        )
        # stand-in id where the bad one was
        assert int(batch[0][1, 7]) == 0 and int(raw[0][1, 7]) == 1000
        assert all(torch.equal(a, b) for a, b in zip(batch[1:], raw[1:]))
    # the checked read still refuses it on its own
    with pytest.raises(DataError, match=r"holds token id 1000"):
        step_batch(order, samples, GLOBAL, GLOBAL, MICRO, 1, DP)


def test_the_agreement_carries_the_stop_and_every_rank_names_it_the_same(
    corrupt, monkeypatch
) -> None:
    samples, order, token, sample = corrupt
    guard_says = [
        Decision(),
        Decision(Action.SKIP, reason="spike"),
    ]  # rank 0's guards see nothing wrong
    own = [
        with_data_stop(guard_says[0], None),
        with_data_stop(
            guard_says[1], Decision(Action.STOP, "bad", ExitCode.BAD_DATA, sample=sample)
        ),
    ]
    # a second bad sample on another rank, later in the step: the lowest one is named
    other = Decision(Action.STOP, "bad", ExitCode.BAD_DATA, sample=sample + 1)

    def all_reduce_max(
        tensor: torch.Tensor, group, op: str = "sum"
    ) -> torch.Tensor:  # three ranks' MAX
        assert (
            op == "max" and tensor.numel() == step_gate.AGREEMENT_FIELDS
        )  # still one small all-reduce per step
        sent = [step_gate.encode(d, False, rank) for rank, d in enumerate(own + [other])]
        return torch.stack(sent).max(dim=0).values

    monkeypatch.setattr(comm, "all_reduce", all_reduce_max)
    lines = []
    for rank, mine in enumerate(own + [other]):
        world = comm.Group("world", (0, 1, 2), rank, comm.CONTROL)
        codes = step_gate.post_agreement(mine, False, False, world, "cpu")
        outcome = step_gate.decode(codes.tolist(), mine, rank)
        agreed, preempted = outcome.decision, outcome.preempted
        assert (agreed.action, agreed.exit_code, agreed.sample, preempted) == (
            Action.STOP,
            ExitCode.BAD_DATA,
            sample,
            False,
        )
        lines.append(named_stop(agreed, samples, order, step=2).reason)
    assert len(set(lines)) == 1
    assert lines[0] == (
        f"{samples.dataset.prefix}.bin: token {token} is id 1000, outside the tokenizer's vocabulary "
        f"[0, 1000) (byte {2 * token}, sequence {token // 100}, document {token // 100}, train sample "
        f"{order.sample_id(sample)} (global sample {sample}), step 2); the file changed or is corrupt "
        "where the pre-launch sample did not look; fix or regenerate it"
    )
