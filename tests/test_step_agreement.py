"""The step's agreement hands every rank one rank's whole decision (keel/training/step_gate.py `encode`/`decode`).

A rollback carries the checkpoint every rank returns to (`to`), whether it restores the LR (`restore`) and whether
it rewinds the data (`rewind_data`); the trainer's collectives depend on them (a rollback without `to` agrees on a
checkpoint first: one more collective). On cbd7c25 a rank whose own action differed from the agreed one rebuilt a
bare Decision, dropping all three — a hang, safe only while every rank's inputs agreed bitwise.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import astuple, replace
from pathlib import Path

import pytest
import torch

from keel.launcher.local import free_port
from keel.parallel import comm
from keel.run_dir import ExitCode
from keel.training import step_gate
from keel.training.guards.base import Action, Decision
from tests.spawned import start_world

ROLLBACK = Decision(Action.ROLLBACK, "corrupt", restore=True, rewind_data=True, to="step00000040")
SKIP = Decision(Action.SKIP, "spike")
STOP = Decision(Action.STOP, "bad data", ExitCode.BAD_DATA, sample=123)


def agreed(
    decisions: list[Decision], signalled: tuple[int, ...] = ()
) -> list[tuple[Decision, bool]]:
    """What each rank acts on when rank r decided decisions[r]: the MAX all-reduce, computed here."""
    sent = [step_gate.encode(d, r in signalled, r) for r, d in enumerate(decisions)]
    codes = torch.stack(sent).max(dim=0).values.tolist()
    out = [step_gate.decode(codes, d, r) for r, d in enumerate(decisions)]
    return [(a.decision, a.preempted) for a in out]


def fields(d: Decision) -> tuple:
    """Everything a rank acts on (the reason is only said)."""
    return astuple(replace(d, reason=""))


@pytest.mark.parametrize("world", [2, 3, 1024])
@pytest.mark.parametrize("where", ["first", "last"])
def test_one_rank_rolls_back_and_every_rank_returns_to_its_checkpoint(world, where):
    decisions = [Decision()] * world
    odd = 0 if where == "first" else world - 1
    decisions[odd] = ROLLBACK
    out = agreed(decisions)
    assert {fields(d) for d, _ in out} == {fields(ROLLBACK)}
    assert out[odd][0].reason == "corrupt"  # its own reason stays with it
    assert all(d.reason == f"decided on rank {odd}" for r, (d, _) in enumerate(out) if r != odd)


def test_the_most_severe_wins_whole_and_ties_go_to_the_lowest_rank():
    other = replace(ROLLBACK, restore=False, rewind_data=False, to="step00000030")
    out = agreed([SKIP, other, ROLLBACK, Decision()])
    assert {fields(d) for d, _ in out} == {fields(other)}  # rank 1 beats rank 2: not a mix of both
    out = agreed([ROLLBACK, STOP, SKIP], signalled=(2,))
    assert {(fields(d), p) for d, p in out} == {(fields(STOP), True)}


def test_exit_code_and_sample_are_agreed_across_ranks():
    late = replace(STOP, sample=500, exit_code=ExitCode.CORRUPT_STATE)
    out = agreed([STOP, late])
    # the highest exit code, the lowest bad sample, whoever decided
    assert {(d.action, d.exit_code, d.sample) for d, _ in out} == {
        (Action.STOP, ExitCode.CORRUPT_STATE, 123)
    }


def test_a_background_save_concludes_when_no_rank_still_writes_it():
    sent = [step_gate.encode(Decision(), False, r, writing=r == 2) for r in range(4)]
    codes = torch.stack(sent).max(dim=0).values.tolist()
    assert all(step_gate.decode(codes, Decision(), r).writing for r in range(4))
    sent = [step_gate.encode(Decision(), False, r) for r in range(4)]
    codes = torch.stack(sent).max(dim=0).values.tolist()
    assert not any(step_gate.decode(codes, Decision(), r).writing for r in range(4))


def test_a_rank_beyond_the_encoding_is_refused():
    with pytest.raises(ValueError, match="up to 1048576 ranks"):
        step_gate.encode(Decision(), False, 2**20)


# -- a real world: the agreement and what follows it are the same collectives on every rank --------------------
def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    import torch.distributed as dist

    from keel.parallel.topology import Topology

    try:
        dist.init_process_group("gloo", rank=rank, world_size=2)
        topology = Topology.from_env()
        topology.trace_into(Path(out))
        control = topology.control("world")
        mine = ROLLBACK if rank == 1 else Decision()
        codes = step_gate.post_agreement(mine, False, False, control, "cpu")
        decision = step_gate.decode(codes.tolist(), mine, rank).decision
        # what the trainer's rollback does next: a rollback without `to` agrees on a checkpoint first
        if decision.to is None:
            comm.broadcast_object("latest", control)
        comm.barrier(control)
        with open(f"{out}/decision{rank}.json", "w") as f:
            json.dump([decision.action, decision.to, decision.restore, decision.rewind_data], f)
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        os._exit(0)  # gloo can abort at interpreter exit


def test_ranks_that_decided_differently_run_the_same_collectives(tmp_path):
    start_world(_worker, (free_port(), str(tmp_path)), 2)
    decisions = [json.loads((tmp_path / f"decision{r}.json").read_text()) for r in range(2)]
    assert decisions[0] == decisions[1] == [int(Action.ROLLBACK), "step00000040", True, True]
    traces = [(tmp_path / f"trace_rank{r}.jsonl").read_text().splitlines() for r in range(2)]
    assert traces[0] == traces[1] and len(traces[0]) == 2  # the agreement, the barrier
