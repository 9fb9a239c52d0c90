"""In-memory checkpoints (keel/training/checkpoint/memory.py): which step a restart takes from where, which
snapshots count, and a crashed job that resumes bitwise from memory. Two nodes and a lost node's memory:
tests/test_memory_netns.py."""

from __future__ import annotations

import json

import pytest

from keel.parallel.topology import Topology
from keel.training.checkpoint.memory import MemoryCheckpoints, _plan, snapshot_name
from keel.training.guards.base import Decision
from keel.training.observe.metrics import read_metrics
from keel.training.step_gate import decode, encode
from tests.keel_runs import Run, keel_train


def _plan_of(reports, disk_step=None, world=None):
    return _plan(reports, disk_step, world or len(reports))


def test_each_rank_reads_its_node_and_a_lost_rank_receives_the_buddy_copy():
    # rank 1 now runs on node b, which lost its memory; node a holds rank 0's own and rank 1's copy
    reports = [
        ("a", [(0, 12, "/a/own-0-12"), (1, 12, "/a/copy-1-12"), (0, 10, "/a/own-0-10")]),
        ("b", []),
    ]
    plan = _plan_of(reports, disk_step=10)
    assert [e.step for e in plan] == [12, 12]
    assert plan[0].read == "/a/own-0-12" and plan[0].receive_from == -1
    assert plan[1].read == "" and plan[1].receive_from == 0
    assert plan[0].send == [(1, "/a/copy-1-12")] and plan[1].send == []


def test_the_newest_step_every_rank_holds_wins_and_a_partial_newer_one_is_passed_over():
    reports = [("a", [(0, 14, "/a/0-14"), (0, 12, "/a/0-12")]), ("b", [(1, 12, "/b/1-12")])]
    plan = _plan_of(reports)
    assert {e.step for e in plan} == {12}
    assert (plan[0].read, plan[1].read) == ("/a/0-12", "/b/1-12")


def test_memory_older_than_disk_or_missing_a_rank_falls_back_to_disk_with_the_reason():
    reports = [("a", [(0, 8, "/a/0-8")]), ("b", [(1, 8, "/b/1-8")])]
    plan = _plan_of(reports, disk_step=10)
    assert all(e.step is None for e in plan)
    assert "step 8, is older than the disk checkpoint of step 10" in plan[0].why
    plan = _plan_of([("a", [(0, 12, "/a/0-12")]), ("b", [])], disk_step=10)
    assert plan[0].step is None and "held for 1 of 2 ranks (none of rank 1's)" in plan[0].why
    assert "none held" in _plan_of([("a", []), ("b", None)])[0].why


def test_a_lost_nodes_ranks_are_served_by_every_rank_of_the_holding_node():
    # two nodes of two ranks; node b (ranks 2, 3) lost everything; node a holds copies of 2 and 3
    held_a = [(r, 6, f"/a/{r}") for r in range(4)]
    reports = [("a", held_a), ("a", None), ("b", []), ("b", None)]
    plan = _plan_of(reports)
    assert [e.receive_from for e in plan] == [-1, -1, 0, 1]  # spread over node a's ranks
    assert plan[0].send == [(2, "/a/2")] and plan[1].send == [(3, "/a/3")]


def test_only_this_runs_snapshots_of_this_layout_with_their_full_size_count(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    memory = MemoryCheckpoints(tmp_path / "shm", 2, Topology.from_env(), run_dir)
    assert memory.buddy is None  # one node: nothing to copy to

    def put(name: str, **meta_changes) -> None:
        path = memory.store / name
        path.write_bytes(b"x" * 10)
        kind, owner, step = name.removesuffix(".pt").split("-")
        meta = memory._meta(int(step[4:]), int(owner[4:]), 10, ["h"]) | meta_changes
        path.with_suffix(".json").write_text(json.dumps(meta))

    memory.store.mkdir(parents=True)
    put(snapshot_name("own", 0, 4))
    put(snapshot_name("own", 0, 6), run_id="another run")
    put(snapshot_name("own", 0, 8), layout={**memory.layout, "tp": 2})
    put(snapshot_name("copy", 0, 10), size=11)  # cut short
    (memory.store / snapshot_name("own", 0, 12)).write_bytes(b"no sidecar")
    assert [(o, s) for o, s, _ in memory.held()] == [(0, 4)]
    memory.discard_after(2)
    assert memory.held() == []


def test_older_snapshots_go_only_once_every_ranks_newest_is_whole(tmp_path):
    """The step's agreement carries each rank's snapshot state (MAX: in flight 2 > failed 1 > whole 0); only an
    agreed 0 drops this rank's older own snapshots — until then a rank lost mid-snapshot leaves a common step."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    memory = MemoryCheckpoints(tmp_path / "shm", 2, Topology.from_env(), run_dir)
    memory.store.mkdir(parents=True)
    for step in (4, 6):
        path = memory.store / snapshot_name("own", 0, step)
        path.write_bytes(b"x")
        path.with_suffix(".json").write_text(json.dumps(memory._meta(step, 0, 1, ["h"])))
    assert memory.state() == 0
    memory._failed = True
    assert memory.state() == 1
    memory.settle()  # nothing taken since the last settle: nothing goes
    assert [s for _, s, _ in memory.held()] == [4, 6]
    memory._unsettled = True
    memory.settle()
    assert [s for _, s, _ in memory.held()] == [6]
    codes = [
        max(v)
        for v in zip(*(encode(Decision(), False, r, snapshot=c) for r, c in enumerate((0, 2, 1))))
    ]
    assert not decode(codes, Decision(), 0).snapshots_settled
    codes = [max(v) for v in zip(*(encode(Decision(), False, r) for r in range(3)))]
    assert decode(codes, Decision(), 0).snapshots_settled


@pytest.mark.slow
def test_a_crashed_job_resumes_from_memory_past_its_disk_checkpoint_bitwise(runs, tmp_path):
    """ZeRO-3 on one node: every rank's snapshot outlives its process (no buddy), and the crash after step 9
    resumes from memory past the disk checkpoint of step 5: from step 8, or — when step 8's snapshot was still in
    flight at the crash (a loaded machine) — from step 6, which every rank keeps until step 8's is whole."""
    sets = dict(train__steps=12, checkpoint__interval=5)
    straight = runs.get("memory-local-ref", 2, "ds_configs/zero3.json", **sets)
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    memory = dict(checkpoint__memory_interval=2, checkpoint__memory_dir=str(shm))
    crashed = runs.overrides(**sets, **memory, faults__crash_step=9)
    out = keel_train(run_dir, 2, crashed, "ds_configs/zero3.json", expect_code=1)
    held = {p.name for p in shm.glob("keel-*/*/*.pt")}
    whole = [s for s in (8, 6) if {snapshot_name("own", r, s) for r in (0, 1)} <= held]
    # with the crashed run's log: an exit 1 before step 9 would be another failure than the one injected
    assert whole and held <= {snapshot_name("own", r, s) for r in (0, 1) for s in (6, 8)}, (
        held,
        out.stdout[-3000:] + out.stderr[-3000:],
    )
    done = keel_train(run_dir, 2, runs.overrides(**sets, **memory), "ds_configs/zero3.json")
    assert f"resumed from the in-memory snapshot of step {whole[0]}" in done.stdout + done.stderr
    got, want = read_metrics(run_dir / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert not list(shm.glob("keel-*/*/*.pt"))  # a finished run clears its snapshots


KEEL_RUNS = [
    Run.of("memory-local-ref", 2, "ds_configs/zero3.json", train__steps=12, checkpoint__interval=5)
]
