"""`keel report` on real runs of other modules (slow, shared launches: no launch of its own in the full suite):
the MoE run with a starved expert (expert load per layer) and a run resumed mid-way (the resume marker)."""

from __future__ import annotations

import json

import pytest

from keel.run_dir import read_anomalies
from keel.tools.report import write_report
from keel.training.observe.metrics import read_metrics
from tests.keel_runs import Run
from tests.report_checks import assert_png_drawn
from tests.test_blend_run import CHANGES as BLEND
from tests.test_moe_training import STARVED

pytestmark = pytest.mark.slow

KEEL_RUNS = [Run.of("starved", 1, **STARVED), Run.of("blend-resumed", 1, resume_at=5, **BLEND)]


def test_report_plots_each_moe_layers_expert_load(runs, tmp_path):
    run = runs.get("starved", 1, **STARVED)
    report = write_report(run, tmp_path / "report")
    assert "experts" in report.drawn
    assert_png_drawn(report.out_dir / "experts.png")
    layers = json.loads((report.out_dir / "series.json").read_text())["plots"]["experts"]["layers"]
    records = [r for r in read_metrics(run / "metrics.jsonl") if "moe" in r]
    assert list(layers) == sorted(records[0]["moe"], key=lambda name: int(name[1:]))
    for name, entry in layers.items():
        assert entry["step"] == [r["step"] for r in records] == list(range(2, 11, 2))
        for row, r in zip(entry["share"], records):
            counts = r["moe"][name]["tokens_per_expert"]
            assert row == pytest.approx([c / sum(counts) for c in counts])
            assert row[2] == 0.0  # the starved expert (faults.starve_expert=2)
    collapses = [e for e in read_anomalies(run) if e["kind"] == "expert_collapse"]
    assert (
        collapses
        and f"expert_collapse {len(collapses)}" in (report.out_dir / "report.md").read_text()
    )


def test_report_marks_where_a_resumed_run_resumed(runs, tmp_path):
    run = runs.get("blend-resumed", 1, resume_at=5, **BLEND)
    resumes = [e for e in read_anomalies(run) if e["kind"] == "resume"]
    assert [(e["step"], e["checkpoint"]) for e in resumes] == [
        (5, "step00000005")
    ]  # the trainer's new event
    report = write_report(run, tmp_path / "report")
    loss = json.loads((report.out_dir / "series.json").read_text())["plots"]["loss"]
    assert loss["resumes"] == [5] and loss["train"]["step"] == list(range(1, 11))
    assert "- resumes: 1: at step 5" in (report.out_dir / "report.md").read_text()
    assert_png_drawn(report.out_dir / "loss.png")
