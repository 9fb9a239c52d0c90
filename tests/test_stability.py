"""Stability guards under real multi-process runs with injected faults."""

from __future__ import annotations

import json

import pytest
import torch

from keel.training.guards.base import read_anomalies
from keel.training.metrics import read_metrics
from tests.keel_runs import REPO, final_weights, keel_train

pytestmark = pytest.mark.slow

GB = 8  # tests/keel_runs.py TINY global batch


def events(run_dir, kind):
    return [e for e in read_anomalies(run_dir) if e["kind"] == kind]


def test_nan_on_one_rank_skips_the_step_everywhere(runs, tmp_path):
    """NaN in rank 1's batch at step 5: skipped on all ranks, diagnosed, and the final weights equal a run whose
    sampler simply skipped that batch."""
    faulty = runs.get("nan", 2, "ds_configs/zero1.json", faults__nan_step=5, faults__nan_rank=1)
    records = read_metrics(faulty / "metrics.jsonl")
    assert [r["step"] for r in records if r["skipped"]] == [5]
    detected, localized = events(faulty, "nonfinite")
    assert detected["step"] == 5 and detected["samples"] == [4 * GB, 5 * GB] and detected["action"] == "skip"
    assert localized["phase"] == "localized" and localized["classification"] == "data"
    assert localized["bad_rank"] == 1 and localized["first_bad_module"] == "layers.0"  # the poisoned embedding
    assert localized["samples"] == [4 * GB + GB // 2]  # the poisoned row: rank 1's first sample of step 5
    clean = tmp_path / "clean"
    keel_train(clean, 2, runs.overrides(data__skip_ranges=json.dumps([f"{4 * GB}:{5 * GB}"]), train__exit_after=9),
               "ds_configs/zero1.json")
    a, b = final_weights(faulty), final_weights(clean)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (faulty / "summary.md").read_text().count("nonfinite") >= 1


def test_spikes_are_skipped_and_a_cluster_rolls_back(runs):
    run = runs.get("spikes", 2, "ds_configs/zero1.json", train__steps=20, checkpoint__interval=5,
                   stability__spike_warmup=5, stability__rollback_window=10, stability__monitor_interval=5,
                   faults__spike_steps="[12, 13, 14]", faults__spike_factor=1000)
    spikes = events(run, "spike")
    assert [e["step"] for e in spikes] == [12, 13, 14]
    assert [e["action"] for e in spikes] == ["skip", "skip", "rollback"]
    (rollback,) = events(run, "rollback")
    assert rollback["to_step"] == 10 and rollback["lr_scale"] == 0.5 and rollback["data_cursor"] == 14 * GB
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 21))
    after = [r for r in records if r["step"] > 10]
    assert all(r["lr_scale"] == 0.5 and not r["skipped"] for r in after)
    assert after[0]["consumed_samples"] == 15 * GB  # the data moved past the spiking window
    summary = (run / "summary.md").read_text()
    assert "rollback: 1" in summary and "spike: 3" in summary
    # TensorBoard event files, read back with tensorboard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events_tb = EventAccumulator(str(run / "tensorboard"))
    events_tb.Reload()
    tags = set(events_tb.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "params/update_ratio", "grad_norm/block0",
            "act/block1/std"} <= tags
    assert [e.step for e in events_tb.Scalars("train/loss")] == list(range(1, 21))  # rolled-back steps replaced


def test_bit_flip_is_detected_naming_parameter_and_rank(runs, tmp_path):
    proc = keel_train(tmp_path, 2, runs.overrides(faults__bitflip_step=6, faults__bitflip_rank=1,
                                                  faults__bitflip_param="layers.1.attention.wq.weight",
                                                  stability__checksum_interval=3),
                      "ds_configs/zero0.json", expect_code=3)
    (event,) = events(tmp_path, "checksum_mismatch")
    assert event["step"] == 6 and event["parameter"] == "layers.1.attention.wq.weight" and event["ranks"] == [1]
    assert "checksum" in proc.stdout + proc.stderr


def test_noisy_rank_is_flagged_by_the_cross_rank_loss_check(runs):
    run = runs.get("noise", 4, faults__noise_rank=2, stability__loss_check_interval=2,
                   stability__loss_check_repeats=2)
    flagged = events(run, "loss_outlier")
    assert flagged and {e["flagged_rank"] for e in flagged} == {2}
    # at initialisation every rank's loss is ~ln(vocab), noise or not; the outlier appears as the others learn
    assert flagged[0]["consecutive"] >= 2 and flagged[0]["sigmas"] > 3


def test_fp16_overflow_storm_halves_the_scale_and_warns(runs, tmp_path):
    ds = json.loads((REPO / "ds_configs" / "fp16.json").read_text())
    ds["fp16"].update(initial_scale_power=40, hysteresis=1, loss_scale_window=1000)
    path = tmp_path / "fp16_storm.json"
    path.write_text(json.dumps(ds))
    run = tmp_path / "run"
    keel_train(run, 2, runs.overrides(stability__loss_scale_halvings=4), str(path))
    records = read_metrics(run / "metrics.jsonl")
    scales = [r["loss_scale"] for r in records]
    skipped = [r["step"] for r in records if r["skipped"]]
    assert len(skipped) >= 4 and scales[skipped[-1] - 1] < 2.0**40 / 2**3  # each overflow halved the scale
    warnings = events(run, "loss_scale")
    assert warnings and "bf16" in warnings[0]["reason"]


def test_sleeping_rank_trips_the_watchdog(runs, tmp_path):
    """Rank 1 stalls in step 4: its stacks are dumped and the run exits with the hang code within T + 10 s."""
    import subprocess
    import sys
    import time

    timeout = 5
    cmd = [sys.executable, "-m", "keel.launcher.cli", "train", "--nproc", "2", "--run-dir", str(tmp_path),
           "--ds-config", str(REPO / "ds_configs" / "zero0.json")]
    for item in runs.overrides(faults__sleep_step=4, faults__sleep_rank=1, faults__sleep_s=120,
                               stability__watchdog_timeout=timeout):
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while not read_metrics(tmp_path / "metrics.jsonl") or read_metrics(tmp_path / "metrics.jsonl")[-1]["step"] < 3:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    stalled_at = time.time()
    proc.communicate(timeout=120)
    assert proc.returncode == 4  # keel.training.watchdog.EXIT_HANG
    assert time.time() - stalled_at <= timeout + 10
    dump = (tmp_path / "stacks" / "rank1-step4.txt").read_text()
    assert "faults.py" in dump and "in before_forward" in dump  # the stalled frame: the injected sleep
    hangs = events(tmp_path, "hang")
    assert any(e["rank"] == 1 and e["step"] == 4 for e in hangs)


def test_batch_rampup_trains_and_resumes_exactly(runs, tmp_path):
    """Ramp-up from 4 to 8 samples over 6 steps (LR following √batch): DeepSpeed's accumulation follows the
    batch, the data cursor follows the ramp, and a resume in the middle of the ramp is exact."""
    sets = dict(train__steps=12, train__rampup_start_batch=4, train__rampup_steps=6, train__rampup_lr_scaling="sqrt")
    straight = runs.get("rampup", 2, "ds_configs/zero1.json", **sets)
    records = read_metrics(straight / "metrics.jsonl")
    sizes = [r["batch_size"] for r in records]
    assert sizes[0] == 4 and sizes[-1] == GB and sizes == sorted(sizes)
    consumed = [r["consumed_samples"] for r in records]
    assert consumed == [sum(sizes[: i + 1]) for i in range(len(sizes))]
    resumed = tmp_path / "resumed"
    keel_train(resumed, 2, runs.overrides(**sets, train__exit_after=3), "ds_configs/zero1.json")
    keel_train(resumed, 2, runs.overrides(**sets), "ds_configs/zero1.json")
    assert [r["loss"] for r in read_metrics(resumed / "metrics.jsonl")] == [r["loss"] for r in records]
