"""`keel report` on real runs with injected faults — the spike run (skipped steps, a rollback, the model monitor)
and the fp16 overflow storm of tests/test_guards_one_rank.py, the same runs: this module adds no launch."""

from __future__ import annotations

import json

from keel.run_dir import read_anomalies
from keel.tools.report import write_report
from keel.training.observe.metrics import read_metrics
from tests.report_checks import assert_png_drawn
from tests.test_guards_one_rank import KEEL_RUNS as GUARD_RUNS
from tests.test_guards_one_rank import SPIKES, STORM

KEEL_RUNS = list(GUARD_RUNS)


def _column(records, key):
    rows = [r for r in records if key in r]
    return {"step": [r["step"] for r in rows], "value": [r[key] for r in rows]}


def test_report_of_the_spike_run_draws_and_marks_what_the_run_wrote(runs, tmp_path):
    run = runs.get("spikes", 1, "ds_configs/zero1.json", **SPIKES)
    report = write_report(run, tmp_path / "report")
    assert report.drawn == [
        "loss",
        "lr",
        "grad_norm",
        "throughput",
        "goodput",
    ]  # every plot the run has data for
    assert set(report.skipped) == {"loss_scale", "stragglers", "experts", "fp8"}
    assert report.left_out == {}
    for name in report.drawn:
        assert_png_drawn(report.out_dir / f"{name}.png")
    plots = json.loads((report.out_dir / "series.json").read_text())["plots"]

    metrics = read_metrics(run / "metrics.jsonl")
    discarded = read_metrics(run / "metrics.discarded.jsonl")
    loss = plots["loss"]
    assert loss["train"] == _column(metrics, "loss")
    assert loss["rolled_back"] == _column(discarded, "loss")
    skipped = sorted(r["step"] for r in metrics + discarded if r["skipped"])
    # exactly the skipped steps
    assert [m["step"] for m in loss["skipped"]] == skipped == [12, 13, 14]
    # each one's record went aside with the rollback
    assert all(m["rolled_back"] for m in loss["skipped"])
    rollbacks = [e for e in read_anomalies(run) if e["kind"] == "rollback"]
    assert loss["rollbacks"] == [{"step": e["step"], "to_step": e["to_step"]} for e in rollbacks]
    assert loss["rollbacks"] == [{"step": 14, "to_step": 10}] and loss["resumes"] == []
    assert plots["lr"]["lr"] == _column(metrics, "lr")
    assert plots["grad_norm"]["grad_norm"] == _column(metrics, "grad_norm")
    per_layer = plots["grad_norm"]["per_layer"]
    # the model's order
    assert list(per_layer)[:2] == ["embedding", "block0"] and len(per_layer) >= 4
    for name, column in per_layer.items():
        assert column == _column(metrics, f"grad_norm/{name}") and column["step"] == [
            5,
            10,
            15,
            20,
        ], name
    assert plots["throughput"]["tokens_per_s"] == _column(metrics, "tokens_per_s")

    text = (report.out_dir / "report.md").read_text()
    assert "- status: finished" in text
    assert "- skipped steps: 3: 12 (rolled back), 13 (rolled back), 14 (rolled back)" in text
    assert "- rollbacks: 1: step 14 → 10" in text and "- resumes: 0" in text
    assert "Events by kind: rollback 1, spike 3" in text
    for step, action in ((12, "skip"), (13, "skip"), (14, "rollback")):
        assert f"| {step} | spike | 0 | action={action}; reason=" in text
    assert "| 14 | rollback | 0 | done=True; reason=3 spikes within 10 steps; to_step=10;" in text
    for name in report.drawn:
        assert f"![{name}]({name}.png)" in text
    assert "- fp16 loss scale (`loss_scale.png`): no loss scale recorded: not an fp16 run" in text


def test_report_of_the_fp16_storm_plots_the_loss_scale(runs, tmp_path):
    run = runs.get(
        "fp16-storm",
        1,
        "ds_configs/fp16.json",
        ds_patch={"fp16": STORM},
        stability__loss_scale_halvings=4,
    )
    report = write_report(run, tmp_path / "report")
    assert "loss_scale" in report.drawn and "loss" in report.drawn
    assert_png_drawn(report.out_dir / "loss_scale.png")
    plots = json.loads((report.out_dir / "series.json").read_text())["plots"]
    metrics = read_metrics(run / "metrics.jsonl")
    assert plots["loss_scale"]["loss_scale"] == _column(metrics, "loss_scale")
    assert plots["loss_scale"]["skipped"] == [r["step"] for r in metrics if r["skipped"]] != []
    assert [m["step"] for m in plots["loss"]["skipped"]] == [
        r["step"] for r in metrics if r["skipped"]
    ]
    # the storm's warnings, in the table
    assert "loss_scale 2" in (report.out_dir / "report.md").read_text()
