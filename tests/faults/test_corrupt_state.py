"""Corrupt state is not bad data: NaN in a rank's weights or optimizer state rolls back (data rewound, LR kept),
never blames samples, never saves over a good checkpoint, and stops with exit code 7 when nothing good is left.

The real runs share launches (tests/keel_runs.py): one one-rank launch (the clean reference, recovery from a
non-finite step and from a refused periodic save, no checkpoint yet, corrupt at the end, a bad batch) and one
two-rank run that joins test_stability.py's launch. One spawned process checks the check on every engine kind.
"""

from __future__ import annotations

import pytest
import torch

from keel.run_dir import AnomalyLog, ExitCode, read_anomalies
from keel.training.guards.base import Action, Decision
from keel.training.guards.localize import DATA, STATE, TRANSIENT, combine_rank_findings
from keel.training.guards.state import CorruptStateGuard, corrupt_state_decision
from keel.training.observe.metrics import read_metrics
from tests.keel_runs import Run, assert_same_weights

ZERO1 = "ds_configs/zero1.json"
GB = 8  # tests/keel_runs.py TINY global batch
SAVES = dict(checkpoint__interval=3)  # steps 3, 6, 9 and the final 10
CORRUPT = dict(SAVES, faults__corrupt_state_step=4, faults__corrupt_state_what="exp_avg_sq")
BEFORE_A_SAVE = dict(SAVES, faults__corrupt_state_step=5, faults__corrupt_state_what="exp_avg_sq")
AT_THE_END = dict(SAVES, faults__corrupt_state_step=10, faults__corrupt_state_what="exp_avg_sq")
TOO_EARLY = dict(
    checkpoint__interval=5, faults__corrupt_state_step=1, faults__corrupt_state_what="master"
)
BAD_BATCH = dict(SAVES, faults__nan_step=5, faults__nan_rank=0)
ON_RANK_1 = dict(CORRUPT, faults__corrupt_state_rank=1)
KEEL_RUNS = [
    Run.of("state-clean", 1, ZERO1, **SAVES),
    Run.of("state-corrupt", 1, ZERO1, **CORRUPT),
    Run.of("state-before-a-save", 1, ZERO1, **BEFORE_A_SAVE),
    Run.of("state-too-early", 1, ZERO1, expect_code=ExitCode.CORRUPT_STATE, **TOO_EARLY),
    Run.of("state-at-the-end", 1, ZERO1, expect_code=ExitCode.CORRUPT_STATE, **AT_THE_END),
    Run.of("state-bad-batch", 1, ZERO1, **BAD_BATCH),
    # tests/test_stability.py's clean two-rank run: the reference for rank 1's
    Run.of("zero1", 2, ZERO1),
    Run.of("state-corrupt-rank1", 2, ZERO1, **ON_RANK_1),
]


def events(run_dir, kind):
    return [e for e in read_anomalies(run_dir) if e["kind"] == kind]


def tags(run_dir) -> list[str]:
    ckpt = run_dir / "checkpoints"
    return sorted(p.name for p in ckpt.iterdir() if p.is_dir()) if ckpt.is_dir() else []


def assert_rolled_back_to_step_3(run) -> None:
    found = events(run, "corrupt_state")[-1]
    assert (
        found["step"] == 6
        and found["action"] == "rollback"
        and found["checkpoint"] == "step00000003"
    )
    assert "samples" not in found  # the samples were innocent
    (rollback,) = events(run, "rollback")
    assert (
        rollback["to_step"] == 3
        and rollback["lr_scale"] == 1.0
        and rollback["data_cursor"] == 3 * GB
    )
    assert not [
        e for e in events(run, "nonfinite") if e.get("phase") == "localized"
    ]  # no data verdict
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 11)) and not any(
        r["skipped"] for r in records
    )
    assert [r["consumed_samples"] for r in records] == [
        GB * s for s in range(1, 11)
    ]  # the data was rewound


@pytest.mark.slow
@pytest.mark.fault(
    "NaN in Adam's exp_avg_sq (one rank)", "corrupt state: roll back, data rewound, LR kept"
)
def test_nan_in_optimizer_state_rolls_back_and_ends_as_if_it_never_happened(runs):
    """NaN in exp_avg_sq after step 4 poisons the weights at step 5 and the loss at step 6: classified as state
    (the fixed batch and the state check), rolled back to step 3, and the run ends bitwise as the clean one."""
    run = runs.get("state-corrupt", 1, ZERO1, **CORRUPT)
    (detected,) = events(run, "nonfinite")
    assert detected["step"] == 6
    (found,) = events(run, "corrupt_state")
    assert (
        found["classification"] == STATE
        and found["fixed_batch_nonfinite"] == [0]
        and found["replay_reproduced"]
    )
    bad = found["bad_state"][
        "0"
    ]  # the master copy and the moments, as the optimizer holds them, and the weights
    assert any(t.startswith("master") for t in bad) and any(t.startswith("exp_avg_sq") for t in bad)
    assert any(t.startswith("param") for t in bad)
    assert_rolled_back_to_step_3(run)
    assert tags(run) == [
        "step00000006",
        "step00000009",
        "step00000010",
    ]  # keep_last: nothing corrupt kept
    assert_same_weights(run, runs.get("state-clean", 1, ZERO1, **SAVES))


@pytest.mark.slow
@pytest.mark.fault(
    "NaN in exp_avg_sq, seen first by a periodic save", "save refused, roll back, data rewound"
)
def test_corrupt_state_at_a_periodic_save_refuses_it_and_rolls_back(runs):
    """NaN in exp_avg_sq after step 5 poisons the weights in step 6's update, before any loss shows it: the save
    at step 6 is refused (nothing written) and the run returns to step 3, ending as the clean run does."""
    run = runs.get("state-before-a-save", 1, ZERO1, **BEFORE_A_SAVE)
    assert not events(run, "nonfinite")
    refused, found = events(run, "corrupt_state")
    assert (
        refused["step"] == 6
        and refused["action"] == "save refused"
        and refused["ranks_with_corrupt_state"] == 1
    )
    assert "checkpoint save" in found["reason"]
    assert_rolled_back_to_step_3(run)
    assert_same_weights(run, runs.get("state-clean", 1, ZERO1, **SAVES))


@pytest.mark.slow
@pytest.mark.fault("NaN in rank 1's exp_avg_sq (ZeRO-1, 2 ranks)", "every rank rolls back together")
def test_corrupt_state_on_one_rank_rolls_every_rank_back(runs):
    run = runs.get("state-corrupt-rank1", 2, ZERO1, **ON_RANK_1)
    assert_rolled_back_to_step_3(run)
    (found,) = events(run, "corrupt_state")
    # named on the rank that holds it
    assert any(t.startswith("exp_avg_sq") for t in found["bad_state"]["1"])
    assert_same_weights(run, runs.get("zero1", 2, ZERO1))


@pytest.mark.slow
@pytest.mark.fault("corrupt state before any checkpoint", "exit 7, nothing saved")
def test_corrupt_state_with_nothing_to_return_to_stops_with_7(runs):
    run = runs.get("state-too-early", 1, ZERO1, expect_code=ExitCode.CORRUPT_STATE, **TOO_EARLY)
    (found,) = events(run, "corrupt_state")
    assert found["action"] == "stop" and found["checkpoint"] is None and found["step"] == 3
    assert tags(run) == [] and not (run / "checkpoints" / "latest").exists()
    assert "exit code 7" in (run / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.fault("corrupt state at the end of a run", "final save refused, latest kept, exit 7")
def test_a_run_ending_corrupt_keeps_the_good_checkpoint_and_exits_7(runs):
    run = runs.get("state-at-the-end", 1, ZERO1, expect_code=ExitCode.CORRUPT_STATE, **AT_THE_END)
    assert tags(run) == [
        "step00000003",
        "step00000006",
        "step00000009",
    ]  # the refused save wrote and pruned nothing
    assert (run / "checkpoints" / "latest").read_text().strip() == "step00000009"
    (refused,) = events(run, "corrupt_state")
    assert (
        refused["step"] == 10 and refused["phase"] == "save" and refused["action"] == "save refused"
    )
    summary = (run / "summary.md").read_text()
    assert "exit code 7" in summary and "last good checkpoint stays latest" in summary


@pytest.mark.slow
@pytest.mark.fault("NaN in one batch (one rank)", "still data: skipped, samples named, no rollback")
def test_a_bad_batch_is_still_data(runs):
    run = runs.get("state-bad-batch", 1, ZERO1, **BAD_BATCH)
    localized = [e for e in events(run, "nonfinite") if e.get("phase") == "localized"]
    assert [e["classification"] for e in localized] == [DATA] and localized[0]["samples"] == [
        4 * GB
    ]
    assert not events(run, "corrupt_state") and not events(run, "rollback")
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["skipped"]] == [5]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step00000010"


# -- the decisions, without a run ----------------------------------------------------------------------------------
def _finding(classification=TRANSIENT, bad_state=0, fixed=False, loss=1.0) -> dict:
    return {
        "classification": classification,
        "replays_nonfinite": 2 if classification == DATA else 0,
        "local_loss": loss,
        "host": "h",
        "samples": [3],
        "bad_state": bad_state,
        "bad_state_tensors": ["exp_avg_sq flat 0"] if bad_state else [],
        "fixed_batch_nonfinite": fixed,
    }


def test_state_outranks_data_and_names_no_samples():
    data_only = combine_rank_findings([_finding(DATA), _finding()])
    assert data_only["classification"] == DATA and data_only["samples"] == [3]
    state = combine_rank_findings([_finding(DATA), _finding(bad_state=1)])
    assert state["classification"] == STATE and state["bad_ranks"] == [1] and "samples" not in state
    assert state["bad_state"] == {"1": ["exp_avg_sq flat 0"]} and state["replay_reproduced"]
    fixed = combine_rank_findings([_finding(DATA, fixed=True), _finding(DATA, fixed=True)])
    assert fixed["classification"] == STATE and fixed["fixed_batch_nonfinite"] == [0, 1]
    assert (
        combine_rank_findings([_finding(), _finding(loss=float("nan"))])["classification"]
        == TRANSIENT
    )


def test_corrupt_state_decisions():
    rollback = corrupt_state_decision("step00000003", again=False, reason="bad")
    assert rollback == Decision(
        Action.ROLLBACK, "bad", restore=True, rewind_data=True, to="step00000003"
    )
    for stop in (
        corrupt_state_decision(None, again=False, reason="bad"),
        corrupt_state_decision("step00000003", again=True, reason="bad"),
    ):
        assert stop.action == Action.STOP and stop.exit_code == ExitCode.CORRUPT_STATE


class _Checkpointer:
    def __init__(self, tag):
        self.tag = tag

    def agreed_at_or_before(self, step):
        return self.tag


class _Topology:
    rank = 0

    def control(self, name):
        return None


def test_state_that_comes_back_after_a_rollback_stops_with_7(tmp_path):
    """Corrupt again before a newer good checkpoint exists: the same rollback would loop, so the run stops."""
    checkpointer = _Checkpointer("step00000003")
    guard = CorruptStateGuard(
        engine=None,
        agreed_checkpoint=checkpointer.agreed_at_or_before,
        topology=_Topology(),
        anomalies=AnomalyLog(tmp_path, 0),
    )
    assert guard.decide(6, "bad").action == Action.ROLLBACK
    again = guard.decide(6, "bad")
    assert (
        again.action == Action.STOP
        and again.exit_code == ExitCode.CORRUPT_STATE
        and "again" in again.reason
    )
    # a newer good checkpoint since: a new occurrence, rolled back again
    checkpointer.tag = "step00000009"
    assert guard.decide(12, "bad").action == Action.ROLLBACK
    assert [e["action"] for e in read_anomalies(tmp_path)] == ["rollback", "stop", "rollback"]


# -- the check on every kind of engine, one spawned process ---------------------------------------------------------
KINDS = ("zero0", "zero1", "zero2", "zero3", "bf16", "fp16")
TARGETS = ("exp_avg_sq", "master", "param")


def _engine(kind: str):
    import json

    from keel.config import ModelConfig, RunConfig, TrainConfig
    from keel.engine.build import build_engine
    from keel.parallel.topology import Topology
    from tests.keel_runs import REPO

    cfg = RunConfig(
        model=ModelConfig(
            vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_pad_multiple=1
        ),
        train=TrainConfig(global_batch_size=2, micro_batch_size=2, lr=1e-2, warmup_steps=0),
    )
    ds = json.loads((REPO / "ds_configs" / f"{kind}.json").read_text())
    if kind == "fp16":
        # the first step must not overflow: it creates the moments
        ds["fp16"]["initial_scale_power"] = 8
    torch.manual_seed(0)
    engine = build_engine(cfg, ds, Topology.from_env())
    batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()
    return engine


def _probe(kind: str) -> dict:
    """The check on a clean engine, then on each target corrupted by the fault hook (restored in between)."""
    from keel.config import FaultsConfig
    from keel.training.faults import FaultInjector
    from keel.training.guards.state import nonfinite_state, state_tensors

    engine = _engine(kind)
    found = {"clean": nonfinite_state(engine)}
    for what in TARGETS:
        saved = [(t, t.clone()) for _, t in state_tensors(engine)]
        FaultInjector(
            FaultsConfig(corrupt_state_step=1, corrupt_state_what=what), 0, engine, 64, 0
        ).after_step(1)
        found[what] = nonfinite_state(engine)
        for tensor, value in saved:
            tensor.copy_(value)
    found["restored"] = nonfinite_state(engine)
    return found


def _probe_worker(_rank: int, port: int, out: str) -> None:
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    from keel.engine.distributed import init_distributed

    init_distributed()
    torch.save({kind: _probe(kind) for kind in KINDS}, out)
    os._exit(0)  # gloo can abort at interpreter exit


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    from keel.launcher.local import free_port

    out = tmp_path_factory.mktemp("state") / "probed.pt"
    mp.start_processes(_probe_worker, args=(free_port(), str(out)), nprocs=1, start_method="spawn")
    return torch.load(out)


@pytest.mark.slow  # one spawned process: DeepSpeed's import and six engines, ~20 s
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.fault(
    "NaN in exp_avg_sq, master or working weights", "the state check names it, on every engine kind"
)
def test_the_state_check_finds_nan_in_every_tensor_of_every_engine_kind(probed, kind):
    found = probed[kind]
    assert found["clean"] == (0, []) and found["restored"] == (0, [])
    for what in TARGETS:
        count, labels = found[what]
        # fp32 ZeRO-0 has no separate master: the working parameter is what the optimizer steps
        label = "master" if what == "param" and kind == "zero0" else what
        assert count >= 1 and any(name.startswith(label) for name in labels), (what, labels)


class _PlainEngine:
    """fp32 ZeRO-0's shape: the module's parameters are what the torch optimizer steps."""

    def __init__(self):
        self.module = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Linear(40, 3))
        self.optimizer = torch.optim.AdamW(self.module.parameters())
        self.module(torch.ones(2, 16)).sum().backward()
        self.optimizer.step()


@pytest.mark.parametrize("where", [0, 7, 639])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_the_chunked_check_sees_any_element_in_any_chunk(monkeypatch, where, value):
    from keel.training.guards import state

    monkeypatch.setattr(state, "CHUNK", 64)  # the 40x16 weight spans 10 chunks
    engine = _PlainEngine()
    assert state.nonfinite_state(engine) == (0, [])
    with torch.no_grad():
        engine.optimizer.state[engine.module[0].weight]["exp_avg"].view(-1)[where] = value
    assert state.nonfinite_state(engine) == (1, ["exp_avg 0.weight"])
    with torch.no_grad():  # a strided view is reduced in place, in chunks of whole rows
        engine.module[0].weight.t()[where % 16, where // 16] = value
    strided = [
        (label, t.t()) if label == "master 0.weight" else (label, t)
        for label, t in state.state_tensors(engine)
    ]
    monkeypatch.setattr(state, "state_tensors", lambda _: iter(strided))
    assert state.nonfinite_state(engine) == (2, ["master 0.weight", "exp_avg 0.weight"])
