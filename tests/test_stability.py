"""Stability guards under real multi-process runs with injected faults."""

from __future__ import annotations

import json

import pytest
import torch

from keel.run_dir import read_anomalies
from keel.run_dir.bad_nodes import hang_suspects, read_bad_nodes
from keel.training.observe.metrics import read_metrics
from tests.keel_runs import REPO, Run, assert_same_weights

pytestmark = pytest.mark.slow

GB = 8  # tests/keel_runs.py TINY global batch
NAN = dict(faults__nan_step=5, faults__nan_rank=1)
# NAN's batch skipped
CLEAN = dict(data__skip_ranges=json.dumps([f"{4 * GB}:{5 * GB}"]), train__exit_after=9)
NOISE = dict(
    faults__noise_rank=2, stability__loss_check_interval=2, stability__loss_check_repeats=2
)
RAMPUP = dict(
    train__steps=12,
    train__rampup_start_batch=4,
    train__rampup_steps=6,
    train__rampup_lr_scaling="sqrt",
)
KEEL_RUNS = [
    Run.of("nan", 2, "ds_configs/zero1.json", **NAN),
    Run.of("nan-clean", 2, "ds_configs/zero1.json", **CLEAN),
    Run.of("noise", 4, **NOISE),
    Run.of("rampup", 2, "ds_configs/zero1.json", **RAMPUP),
    Run.of("rampup-resumed", 2, "ds_configs/zero1.json", resume_at=3, **RAMPUP),
]
FLIPPED = "layers.2.feed_forward.w2.weight"  # in rank 1's ZeRO-1/2 partition (the second half of its group)
BITFLIP = dict(
    faults__bitflip_step=5,
    faults__bitflip_rank=1,
    faults__bitflip_param=FLIPPED,
    stability__checksum_interval=2,
    stability__checksum_action="warn",
    stability__monitor_interval=4,
)
STAGES = (0, 1, 2, 3)
# the flipped runs, and the clean runs of tests/test_train_equivalence.py (the same runs: they share one launch)
KEEL_RUNS += [Run.of(f"bitflip-zero{s}", 2, f"ds_configs/zero{s}.json", **BITFLIP) for s in STAGES]
KEEL_RUNS += [Run.of(f"zero{s}", 2, f"ds_configs/zero{s}.json") for s in STAGES]
# the default action, stop, ends this run with exit code 3; the world goes on to the others in its launch
BITFLIP_STOP = dict(
    faults__bitflip_step=5,
    faults__bitflip_rank=1,
    stability__checksum_interval=3,
    faults__bitflip_param="layers.1.attention.wq.weight",
)
KEEL_RUNS += [Run.of("bitflip-stop", 2, "ds_configs/zero0.json", expect_code=3, **BITFLIP_STOP)]


def events(run_dir, kind):
    return [e for e in read_anomalies(run_dir) if e["kind"] == kind]


@pytest.mark.fault(
    "NaN in one rank's batch", "step skipped on every rank; the bad sample localized and recorded"
)
def test_nan_on_one_rank_skips_the_step_everywhere(runs):
    """NaN in rank 1's batch at step 5: skipped on all ranks, diagnosed, and the final weights equal a run whose
    sampler simply skipped that batch."""
    faulty = runs.get("nan", 2, "ds_configs/zero1.json", **NAN)
    records = read_metrics(faulty / "metrics.jsonl")
    assert [r["step"] for r in records if r["skipped"]] == [5]
    detected, localized = events(faulty, "nonfinite")
    assert (
        detected["step"] == 5
        and detected["samples"] == [4 * GB, 5 * GB]
        and detected["action"] == "skip"
    )
    assert localized["phase"] == "localized" and localized["classification"] == "data"
    # the poisoned embedding
    assert localized["bad_rank"] == 1 and localized["first_bad_module"] == "layers.0"
    assert localized["samples"] == [
        4 * GB + GB // 2
    ]  # the poisoned row: rank 1's first sample of step 5
    clean = runs.get("nan-clean", 2, "ds_configs/zero1.json", **CLEAN)
    assert_same_weights(faulty, clean)
    assert (faulty / "summary.md").read_text().count("nonfinite") >= 1


@pytest.mark.fault(
    "bit flip in one replica's weights (ZeRO-0)", "checksums name parameter and rank; exit 3"
)
def test_bit_flip_is_detected_naming_parameter_and_rank(runs):
    """The default action stops the run (exit code 3, checked by the shared launch) at the first check after the
    flip. With two replicas the comparison cannot tell which one is wrong (both named, `ambiguous`); rank 1's own
    at-rest check names it."""
    run = runs.get("bitflip-stop", 2, "ds_configs/zero0.json", expect_code=3, **BITFLIP_STOP)
    at_rest, replicas = sorted(events(run, "checksum_mismatch"), key=lambda e: e["group"])
    assert at_rest["step"] == 6 and at_rest["parameter"] == "layers.1.attention.wq.weight"
    assert (
        at_rest["group"] == "at_rest" and at_rest["ranks"] == [1] and at_rest["states"] == ["param"]
    )
    assert replicas["step"] == 6 and replicas["parameter"] == "layers.1.attention.wq.weight"
    assert replicas["ranks"] == [0, 1] and replicas["ambiguous"]
    # rank 1's node is recorded for the next attempt to leave out (the ambiguous comparison names nobody)
    bad = [(n.reason, n.step, n.evidence["ranks"]) for n in read_bad_nodes(run)]
    assert bad == [("checksum", 6, [1])], bad
    assert (
        "- status: stopped early (exit code 3): parameter checksum mismatch"
        in (run / "summary.md").read_text()
    )


def _checkpoint_tensors(run_dir) -> list[torch.Tensor]:
    """Every tensor of the final checkpoint, every rank's files (ZeRO-1/2/3 keep the fp32 truth in optimizer files)."""
    ckpt = run_dir / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    tensors = []
    for path in sorted((ckpt / tag).glob("*.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        tensors += [
            t for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor)
        ]
    return tensors


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.fault(
    "low bit flip in a rank's fp32 partition (ZeRO 0-3)",
    "at-rest checksum names rank and parameter",
)
def test_low_bit_flip_in_the_source_of_truth_is_caught_at_every_zero_stage(runs, stage):
    """A low mantissa bit of rank 1's copy of the state the next steps are rebuilt from (the parameter at ZeRO-0,
    its fp32 partition at ZeRO-1/2/3) flips after step 5: the next check (step 6) names rank 1 and the parameter. With
    `warn` the run goes on, and its final state differs from the clean run's (which has the same losses up to the
    flip): the flip is real, and at ZeRO-1/2/3 no replica comparison could have seen it."""
    run = runs.get(f"bitflip-zero{stage}", 2, f"ds_configs/zero{stage}.json", **BITFLIP)
    found = events(run, "checksum_mismatch")
    assert found and found[0]["step"] == 6, found
    at_rest = [e for e in found if e["group"] == "at_rest"]
    assert [(e["step"], e["parameter"], e["ranks"]) for e in at_rest] == [(6, FLIPPED, [1])], found
    assert at_rest[0]["states"][0] == ("param" if stage == 0 else "fp32")
    assert [(n.reason, n.evidence["ranks"]) for n in read_bad_nodes(run)] == [("checksum", [1])]
    replicas = [e for e in found if e["group"] != "at_rest"]
    if stage == 0:  # the replicas differ: the cross-replica comparison sees it too
        assert replicas[0]["step"] == 6 and {e["parameter"] for e in replicas} == {FLIPPED}
        # two replicas: no majority
        assert all(e["ranks"] == [0, 1] and e["ambiguous"] for e in replicas)
    else:  # the working copies are rebuilt from the partitions, so replicas agree
        assert replicas == []
    clean = runs.get(f"zero{stage}", 2, f"ds_configs/zero{stage}.json")
    flipped_losses, clean_losses = (
        read_metrics(run / "metrics.jsonl"),
        read_metrics(clean / "metrics.jsonl"),
    )
    assert [r["loss"] for r in flipped_losses[:5]] == [r["loss"] for r in clean_losses[:5]]
    a, b = _checkpoint_tensors(run), _checkpoint_tensors(clean)
    assert len(a) == len(b) and not all(torch.equal(x, y) for x, y in zip(a, b))


def test_monitor_statistics_agree_at_every_zero_stage(runs):
    """The monitor reads local shards (ZeRO-0: each replica's half of every parameter; ZeRO-1/2/3: each rank's
    partition) and reduces squares once over the world: its step-4 statistics (before the flip) are the same at
    every stage on 2 ranks, and the per-layer gradient norms add up to the step's global norm."""
    records = {
        s: read_metrics(
            runs.get(f"bitflip-zero{s}", 2, f"ds_configs/zero{s}.json", **BITFLIP) / "metrics.jsonl"
        )[3]
        for s in STAGES
    }
    want = records[0]
    keys = [k for k in want if k.startswith(("grad_norm/", "params/", "act/"))]
    assert {"params/norm", "params/update_ratio", "grad_norm/embedding", "act/block1/std"} <= set(
        keys
    )
    for stage, got in records.items():
        assert got["step"] == 4 and keys == [
            k for k in got if k.startswith(("grad_norm/", "params/", "act/"))
        ]
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (stage, key)
        layers = [k for k in keys if k.startswith("grad_norm/")]
        assert sum(got[k] ** 2 for k in layers) ** 0.5 == pytest.approx(
            got["grad_norm"], rel=1e-5
        ), stage


@pytest.mark.fault("one rank trains on garbage data", "cross-rank loss check flags that rank")
def test_noisy_rank_is_flagged_by_the_cross_rank_loss_check(runs):
    run = runs.get("noise", 4, **NOISE)
    flagged = events(run, "loss_outlier")
    assert flagged and {e["flagged_rank"] for e in flagged} == {2}
    # at initialisation every rank's loss is ~ln(vocab), noise or not; the outlier appears as the others learn
    assert flagged[0]["consecutive"] >= 2 and flagged[0]["sigmas"] > 3


@pytest.mark.fault("rank stalls inside a step", "watchdog dumps stacks; every rank exits 4")
def test_sleeping_rank_trips_the_watchdog(runs, tmp_path):
    """Rank 1 stalls in step 4: its stacks are dumped and the run exits with the hang code (bench/recovery.py
    measures how long detection takes)."""
    import subprocess
    import sys
    import time

    timeout = 5
    cmd = [
        sys.executable,
        "-m",
        "keel.launcher.cli",
        "train",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path),
        "--ds-config",
        str(REPO / "ds_configs" / "zero0.json"),
    ]
    for item in runs.overrides(
        faults__sleep_step=4,
        faults__sleep_rank=1,
        faults__sleep_s=120,
        stability__watchdog_timeout=timeout,
    ):
        cmd += ["--set", item]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    while (
        not read_metrics(tmp_path / "metrics.jsonl")
        or read_metrics(tmp_path / "metrics.jsonl")[-1]["step"] < 3
    ):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    stalled_at = time.time()
    proc.communicate(timeout=120)
    assert proc.returncode == 4  # keel.run_dir.ExitCode.HANG
    print(
        f"watchdog: ranks exited {time.time() - stalled_at:.1f} s after step 3 (timeout {timeout} s)"
    )
    dump = (tmp_path / "stacks" / "rank1-step4.txt").read_text()
    # the stalled frame: the injected sleep
    assert "faults.py" in dump and "in before_forward" in dump
    hangs = events(tmp_path, "hang")
    assert any(e["rank"] == 1 and e["step"] == 4 for e in hangs)
    # rank 1 was stuck in its own work; rank 0, when it lived to say so, was waiting on it in a collective
    waiting = {e["rank"]: e["waiting"] for e in hangs}
    assert waiting[1] is False and waiting.get(0, True) is True, hangs
    if (
        0 in waiting
    ):  # rank 0 lived to record its wait (torchrun may end it first): rank 1's node is named
        assert [n.evidence["rank"] for n in hang_suspects(hangs)] == [1]


def test_batch_rampup_trains_and_resumes_exactly(runs):
    """Ramp-up from 4 to 8 samples over 6 steps (LR following √batch): DeepSpeed's accumulation follows the
    batch, the data cursor follows the ramp, and resuming every 3 steps (twice in the ramp) is exact."""
    sets = RAMPUP
    straight = runs.get("rampup", 2, "ds_configs/zero1.json", **sets)
    records = read_metrics(straight / "metrics.jsonl")
    sizes = [r["batch_size"] for r in records]
    assert sizes[0] == 4 and sizes[-1] == GB and sizes == sorted(sizes)
    consumed = [r["consumed_samples"] for r in records]
    assert consumed == [sum(sizes[: i + 1]) for i in range(len(sizes))]
    resumed = runs.get("rampup-resumed", 2, "ds_configs/zero1.json", resume_at=3, **sets)
    assert [r["loss"] for r in read_metrics(resumed / "metrics.jsonl")] == [
        r["loss"] for r in records
    ]
