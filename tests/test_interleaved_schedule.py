"""Megatron's interleaved 1F1B as Keel generates it (keel/engine/interleaved_schedule.py): the order, the
timetable, the transfers every rank must post in the same batch as its peer, and what a posted batch keeps alive.
The runs themselves are in
tests/test_pipeline_schedules.py, the bubble in tests/test_pipeline_bubble.py."""

from __future__ import annotations

import gc
import threading
import weakref
from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from keel.config import ConfigError, RunConfig
from keel.config.rules import validate
from keel.engine.interleaved_engine import _Batch
from keel.engine.interleaved_schedule import (
    Work,
    interleaved_schedule_class,
    megatron_order,
    timetable,
)
from keel.engine.memory_model import rank_stages

GRID = [(p, k * p, v) for p in (2, 3, 4, 8) for v in (2, 3, 4) for k in (1, 2, 3)]


def test_order_is_megatrons():
    """p=2, m=4, v=2 as Megatron-LM's interleaved schedule runs it on rank 0: 4 warm-up forwards (groups of two
    micro-batches through chunk 0, then chunk 1), one forward one backward, backwards in reverse chunk order."""
    got = [
        " ".join(f"{w.kind}{w.chunk}.{w.micro_batch}" for w in it)
        for it in megatron_order(2, 4, 2, rank=0)
    ]
    assert got == [
        "F0.0",
        "F0.1",
        "F1.0",
        "F1.1",
        "F0.2 B1.0",
        "F0.3 B1.1",
        "F1.2 B0.0",
        "F1.3 B0.1",
        "B1.2",
        "B1.3",
        "B0.2",
        "B0.3",
    ]
    assert sum(map(len, megatron_order(2, 4, 2, rank=1))) == 16


@pytest.mark.parametrize("p, m, v", GRID)
def test_timetable_runs_everything_once_after_its_input(p, m, v):
    table = timetable(p, m, v)
    made = {}
    for t in range(len(table[0])):
        for rank in range(p):
            for work in table[rank][t]:
                made[rank, work] = t
    for rank in range(p):
        done = [it for it in table[rank] if it]
        assert done == megatron_order(p, m, v, rank)  # every iteration once, in Megatron's order
        assert len(Counter(w for it in done for w in it)) == 2 * m * v
    for (rank, work), t in made.items():
        stage = work.chunk * p + rank
        if work.kind == "F" and stage > 0:
            assert made[(stage - 1) % p, Work("F", (stage - 1) // p, work.micro_batch)] < t
        elif work.kind == "B" and stage < v * p - 1:
            assert made[(stage + 1) % p, Work("B", (stage + 1) // p, work.micro_batch)] < t
        # the loss stage: its own forward, earlier or earlier in the same iteration
        elif work.kind == "B":
            assert made[rank, Work("F", work.chunk, work.micro_batch)] <= t


@pytest.mark.parametrize("p, m, v", GRID)
@pytest.mark.parametrize("forward_only", [False, True])
def test_each_transfer_is_posted_by_both_ranks_in_the_same_batch(p, m, v, forward_only):
    """What makes the schedule hang-free (module docstring): between any two ranks, the k-th batch (instructions up
    to a CommitP2P) that carries transfers between them holds, on each side, exactly the other's sends as its
    receives, buffer for buffer: blocking or grouped p2p (NCCL) then always finds its peer's matching operation."""
    schedule = interleaved_schedule_class()
    batches = [
        _batches(schedule(m, p, rank, v, forward_only).steps(), rank, p, m) for rank in range(p)
    ]
    assert _matched_in_posting_order(batches, p) > 0
    if not forward_only:
        tail = list(schedule(m, p, 0, v).steps())[-1]
        assert [type(c).__name__ for c in tail][-3:] == [
            "ReduceTiedGrads",
            "ReduceGrads",
            "OptimizerStep",
        ]


def _matched_in_posting_order(batches: list[list[tuple[int, str, int, bool]]], p: int) -> int:
    """Assert that between any two ranks the k-th batch carrying transfers holds, in posting order and one
    direction at a time, the one's sends as the other's receives; returns how many batches carried sends.

    NCCL pairs the k-th send to a peer with that peer's k-th receive from it, so at p=2 (one peer both ways) a
    swapped activation and gradient of one shape would be matched with each other: silent corruption, not a
    hang. Comparing sorted batches would not see it."""
    pairs = 0
    for a in range(p):
        for b in {(a + 1) % p, (a - 1) % p} - {a}:
            sends = [
                [(kind, mb) for peer, kind, mb, out in batch if peer == b and out]
                for batch in batches[a]
            ]
            receives = [
                [(kind, mb) for peer, kind, mb, out in batch if peer == a and not out]
                for batch in batches[b]
            ]
            assert [x for x in sends if x] == [x for x in receives if x]
            pairs += sum(map(bool, sends))
    return pairs


def test_the_pairing_check_sees_a_swapped_order():
    """At p=2 some batch sends an activation and a gradient to the one peer: swapped, the check fails."""
    p, m, v = 2, 4, 2
    schedule = interleaved_schedule_class()
    batches = [_batches(schedule(m, p, rank, v).steps(), rank, p, m) for rank in range(p)]
    assert _matched_in_posting_order(batches, p) > 0
    both = next(
        (i, batch)
        for i, batch in enumerate(batches[0])
        if len({kind for _, kind, _, out in batch if out}) == 2
    )
    index, batch = both
    outgoing = [j for j, t in enumerate(batch) if t[3]]
    first, second = outgoing[0], next(j for j in outgoing if batch[j][1] != batch[outgoing[0]][1])
    swapped = list(batch)
    swapped[first], swapped[second] = batch[second], batch[first]
    batches[0][index] = swapped
    with pytest.raises(AssertionError):
        _matched_in_posting_order(batches, p)


def _batches(steps, rank: int, p: int, m: int) -> list[list[tuple[int, str, int, bool]]]:
    """(peer, kind, micro-batch, outgoing) of every p2p instruction, batch by batch (a CommitP2P ends a batch)."""
    batches: list[list[tuple[int, str, int, bool]]] = [[]]
    for commands in steps:
        for cmd in commands:
            name = type(cmd).__name__
            if name == "CommitP2P":
                batches.append([])
            elif name in ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad"):
                forward, outgoing = name.endswith("Activation"), name.startswith("Send")
                peer = (rank + 1) % p if forward == outgoing else (rank - 1) % p
                batches[-1].append(
                    (peer, "act" if forward else "grad", cmd.buffer_id % m, outgoing)
                )
    return batches


def test_micro_batches_not_in_groups_of_p_are_refused():
    with pytest.raises(ValueError, match="groups of the 2 pipeline ranks"):
        timetable(2, 5, 2)
    with pytest.raises(ValueError, match="at least 2 pipeline ranks and 2 chunks"):
        timetable(2, 4, 1)


def test_rank_stages_round_the_ring():
    assert rank_stages(2, "interleaved", 2) == [(0, 2), (1, 3)]
    assert rank_stages(4, "interleaved", 3) == [(0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11)]


def _config(**parallel) -> RunConfig:
    cfg = RunConfig()
    cfg.model.n_layers = 4
    cfg.parallel.pp = 2
    cfg.parallel.pipeline_schedule = "interleaved"
    cfg.parallel.pipeline_partition = "type:Block"
    cfg.train.micro_batch_size = 2
    cfg.train.global_batch_size = 8
    cfg.train.eval_batches = 4
    for key, value in parallel.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.mark.parametrize(
    "change, field",
    [
        (
            dict(train__global_batch_size=10),
            "train.global_batch_size",
        ),  # 5 micro-batches: not in groups of 2
        (
            dict(train__global_batch_size=12, parallel__pp=4, model__n_layers=8),
            "parallel.pipeline_schedule=interleaved needs at least",
        ),
        (dict(train__eval_batches=3), "train.eval_batches"),
        (dict(train__rampup_start_batch=4, train__rampup_steps=2), "train.rampup_start_batch"),
        (dict(parallel__virtual_stages=4), "parallel.virtual_stages"),  # 8 stages, 7 layers
        (dict(model__moe_experts=4), "model.moe_experts"),
        (dict(parallel__pp=1), "parallel.pp"),
    ],
)
def test_bad_interleaved_configs_are_refused_in_one_line(change, field):
    cfg = _config(**change)
    with pytest.raises(ConfigError) as refused:
        validate(cfg, world_size=cfg.parallel.pp)
    message = str(refused.value)
    assert "\n" not in message and field in message, message


def test_a_good_interleaved_config_passes():
    validate(_config(), world_size=2)


def test_a_waited_batch_lets_its_sent_tensors_go():
    """The engine keeps every batch it posts until the step's end, and a gloo work holds its tensors until it is
    destroyed: a waited batch must drop its works, or each activation and gradient a rank sends lives to the
    step's end (m·v of each per step: at 70B scale, tens of GiB)."""
    store, groups, sent_ref = dist.HashStore(), {}, {}

    def rank_main(rank: int) -> None:
        groups[rank] = group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))
        if rank == 0:
            sent = torch.ones(1 << 16)
            sent_ref[0] = weakref.ref(sent)
            batch = _Batch([group.send([sent], 1, 0)], [sent])
            del sent
            batch.wait()
            groups["batch"] = batch  # kept, as the engine keeps it
        else:
            group.recv([torch.empty(1 << 16)], 0, 0).wait()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gc.collect()
    assert groups["batch"].done
    assert sent_ref[0]() is None
