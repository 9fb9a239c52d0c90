"""Every rank issues the same collectives, in the same order, on every group (the rule that keeps 512 ranks from
hanging), checked on the collectives real runs recorded (`logging.collective_trace`, keel/parallel/comm.py).

Per process group, each member rank's ordered list of (op, channel, dtype, numel) must be identical. On gloo a
mixed-device collective cannot hang, so the channel each call took is part of what is compared; the lint in
tests/test_comm_rule.py keeps calls from bypassing the recording. Runs: 8 ranks pp2 × tp2 × dp2 (ep2, Megatron SP);
8 ranks tp2 × Ulysses sp2 × ep2; 4 ranks context parallel cp2 × Ulysses sp2, and cp2 × dp2 with ep2; 4 ranks with
every guard, the monitor, evaluation and checkpoints every step or two, once plain (tp2 × dp2) and once as tp2 × pp2
under DualPipeV.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from keel.training.step_gate import AGREEMENT_FIELDS
from tests.keel_runs import Run
from tests.test_context_parallel_training import CP2_EP2, CP2_SP2
from tests.test_moe_training import FOUR_D, TP_SP_EP
from tests.test_pipeline_schedules import SCHEDULES

pytestmark = pytest.mark.slow

TRACED_TP2 = dict(parallel__tp=2, logging__collective_trace="true")
PERIODIC_CHECKS = ("checksum", "loss_check", "straggler", "monitor")  # stability.<check>_interval
ALL_GUARDS = dict(
    **TRACED_TP2,
    train__eval_interval=5,
    checkpoint__interval=5,
    **{f"stability__{check}_interval": 2 for check in PERIODIC_CHECKS},
)
# every periodic check off: what is left between the first and the last step is the steps themselves
QUIET = dict(
    **TRACED_TP2,
    train__steps=12,
    **{f"stability__{check}_interval": 0 for check in PERIODIC_CHECKS},
)
TRACED = {
    "quiet": Run.of("quiet", 4, "ds_configs/zero1.json", **QUIET),
    "4d": Run.of("4d", 8, "ds_configs/zero1.json", **FOUR_D),
    "tp2sp2ep2": Run.of("tp2sp2ep2", 8, "ds_configs/zero2.json", **TP_SP_EP),
    # context parallel: its ring shifts are traced like collectives (every cp rank sends the same)
    "cp2sp2": Run.of("cp2sp2", 4, "ds_configs/zero1.json", **CP2_SP2),
    "cp2ep2": Run.of("cp2ep2", 4, "ds_configs/zero1.json", **CP2_EP2),
    "all-guards": Run.of("all-guards", 4, "ds_configs/zero1.json", **ALL_GUARDS),
    **{
        f"{name}-all-guards": Run.of(
            f"{name}-all-guards", 4, "ds_configs/zero1.json", **ALL_GUARDS, **schedule
        )
        for name, schedule in SCHEDULES.items()
    },
}
KEEL_RUNS = list(TRACED.values())

Call = tuple[str, str, str, int]  # op, channel, dtype, numel


def read_traces(run_dir: Path) -> dict[int, list[dict]]:
    traces = {}
    for path in sorted((run_dir / "collectives").glob("trace_rank*.jsonl")):
        rank = int(path.stem.removeprefix("trace_rank"))
        traces[rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return traces


def divergences(traces: dict[int, list[dict]]) -> list[str]:
    """Where member ranks of a group issued different sequences: one line per group, naming the first difference."""
    per_group: dict[tuple[str, tuple[int, ...]], dict[int, list[Call]]] = defaultdict(dict)
    for rank, entries in traces.items():
        for e in entries:
            key = (e["group"], tuple(e["ranks"]))
            per_group[key].setdefault(rank, []).append(
                (e["op"], e["channel"], e["dtype"], e["numel"])
            )
    problems = []
    for (name, ranks), calls in sorted(per_group.items()):
        sequences = {rank: calls.get(rank, []) for rank in ranks}
        reference_rank = ranks[0]
        for rank, seq in sequences.items():
            if seq != sequences[reference_rank]:
                first = next(
                    (i for i, (a, b) in enumerate(zip(seq, sequences[reference_rank])) if a != b),
                    min(len(seq), len(sequences[reference_rank])),
                )
                problems.append(
                    f"group {name} {list(ranks)}: rank {rank} differs from rank {reference_rank} at call "
                    f"{first} ({len(seq)} vs {len(sequences[reference_rank])} calls)"
                )
                break
    return problems


@pytest.mark.fault("ranks issue different collectives", "trace comparison names the divergence")
def test_divergence_is_found():
    """The comparison can fail: an extra call, a different size, or another channel on one rank."""
    call = {
        "op": "all_reduce_max",
        "group": "world",
        "ranks": [0, 1],
        "channel": "control",
        "dtype": "int64",
        "numel": 2,
    }
    same = {0: [call, call], 1: [call, call]}
    assert divergences(same) == []
    assert divergences({0: [call, call], 1: [call]}) != []
    assert divergences({0: [call], 1: [{**call, "numel": 3}]}) != []
    assert divergences({0: [call], 1: [{**call, "channel": "device"}]}) != []
    assert divergences({0: [call], 1: []}) != []  # a rank that never entered


@pytest.mark.parametrize("name", list(TRACED))
def test_every_rank_issues_the_same_collectives(runs, name):
    run = TRACED[name]
    run_dir = runs.run(run)
    traces = read_traces(run_dir)
    assert sorted(traces) == list(range(run.nproc))
    assert divergences(traces) == []
    channels = {e["channel"] for entries in traces.values() for e in entries}
    assert channels == {"device", "control"}
    if name.startswith("cp"):  # the ring's K/V and dK/dV go round the cp group, each rank's in turn
        rings = {
            e["group"] for entries in traces.values() for e in entries if e["op"] == "ring_shift"
        }
        assert rings == {"cp"}  # control: the periodic checks, saves, evaluation's
    # the step's agreement (a rank's data stop, whole; preemption flag; background save writing) is one small
    # device collective beside the loss, read back with it
    steps = max(
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    )
    for rank, entries in traces.items():
        agreements = [
            e
            for e in entries
            if e["group"] == "world"
            and e["op"] == "all_reduce_max"
            and e["channel"] == "device"
            and e["dtype"] == "int64"
            and e["numel"] == AGREEMENT_FIELDS
        ]
        assert len(agreements) == steps, (rank, len(agreements), steps)
        control_tensors = [
            e for e in entries if e["channel"] == "control" and e["dtype"] != "object"
        ]
        assert all(e["device"] == "cpu" for e in control_tensors)


def test_a_step_issues_no_control_channel_collective(runs):
    """Zero control-channel collectives per step: with every periodic check off, nothing but the steps' own
    collectives lies between a rank's first and last step agreement — all on the device channel (on cbd7c25 the
    agreement itself was a control-channel all-reduce over the world, every step)."""
    run = TRACED["quiet"]
    traces = read_traces(runs.run(run))
    for rank, entries in traces.items():
        marks = [
            i
            for i, e in enumerate(entries)
            if e["group"] == "world"
            and e["op"] == "all_reduce_max"
            and e["numel"] == AGREEMENT_FIELDS
        ]
        assert len(marks) == 12, (rank, len(marks))
        between = entries[marks[0] : marks[-1] + 1]
        assert [e for e in between if e["channel"] == "control"] == [], rank
        assert {e["group"] for e in between} <= {"world", "dp", "tp"}
