"""Guard and trainer logic that needs no second rank, on a real one-rank `keel train` (real DeepSpeed engine,
the whole trainer loop): spike skip and rollback, the fp16 overflow storm. Part of the default suite; the
cross-rank guards (NaN on one rank skipped everywhere, bit flips, noisy ranks, hangs) are in test_stability.py.
"""

from __future__ import annotations

import pytest

from keel.run_dir import read_anomalies
from keel.training.observe.metrics import read_metrics
from tests.keel_runs import Run

GB = 8  # tests/keel_runs.py TINY global batch
SPIKES = dict(
    train__steps=20,
    checkpoint__interval=5,
    stability__spike_warmup=5,
    stability__rollback_window=10,
    stability__monitor_interval=5,
    faults__spike_steps="[12, 13, 14]",
    faults__spike_factor=1000,
)
# every early step overflows
STORM = dict(initial_scale_power=40, hysteresis=1, loss_scale_window=1000)
KEEL_RUNS = [
    Run.of("spikes", 1, "ds_configs/zero1.json", **SPIKES),
    Run.of(
        "fp16-storm",
        1,
        "ds_configs/fp16.json",
        ds_patch={"fp16": STORM},
        stability__loss_scale_halvings=4,
    ),
]


def events(run_dir, kind):
    return [e for e in read_anomalies(run_dir) if e["kind"] == kind]


@pytest.mark.fault("loss spikes", "skipped; a cluster rolls back with the LR halved")
def test_spikes_are_skipped_and_a_cluster_rolls_back(runs):
    run = runs.get("spikes", 1, "ds_configs/zero1.json", **SPIKES)
    spikes = events(run, "spike")
    assert [e["step"] for e in spikes] == [12, 13, 14]
    assert [e["action"] for e in spikes] == ["skip", "skip", "rollback"]
    (rollback,) = events(run, "rollback")
    assert (
        rollback["to_step"] == 10
        and rollback["lr_scale"] == 0.5
        and rollback["data_cursor"] == 14 * GB
    )
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
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "params/update_ratio",
        "grad_norm/block0",
        "act/block1/std",
    } <= tags
    # rolled-back steps replaced
    assert [e.step for e in events_tb.Scalars("train/loss")] == list(range(1, 21))


@pytest.mark.fault("fp16 overflow storm", "steps skipped, loss scale halved, warning to use bf16")
def test_fp16_overflow_storm_halves_the_scale_and_warns(runs):
    run = runs.get(
        "fp16-storm",
        1,
        "ds_configs/fp16.json",
        ds_patch={"fp16": STORM},
        stability__loss_scale_halvings=4,
    )
    records = read_metrics(run / "metrics.jsonl")
    scales = [r["loss_scale"] for r in records]
    skipped = [r["step"] for r in records if r["skipped"]]
    # each overflow halved the scale
    assert len(skipped) >= 4 and scales[skipped[-1] - 1] < 2.0**40 / 2**3
    warnings = events(run, "loss_scale")
    assert warnings and "bf16" in warnings[0]["reason"]
