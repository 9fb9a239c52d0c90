"""The main job end to end: `keel train` as a user runs it, and under an external launcher (torchrun)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from keel.tools.report import write_report
from keel.training.observe.metrics import FIELDS, read_metrics
from tests.keel_runs import REPO, Run

pytestmark = pytest.mark.slow
KEEL_RUNS = [Run.of("zero0", 2)]


def test_default_run_learns(tmp_path):
    """The README's first command: the tiny default config on the embedded corpus, several local ranks."""
    proc = subprocess.run(
        [sys.executable, "-m", "keel.launcher.cli", "train", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 301))
    for r in records:
        assert set(FIELDS) <= r.keys()
        assert r["loss_scale"] is None and r["skipped"] is False
    first = sum(r["loss"] for r in records[:10]) / 10
    last = sum(r["loss"] for r in records[-10:]) / 10
    assert last < first - 2.0, (first, last)
    assert any("val_loss" in r for r in records)
    assert "step    300/300" in proc.stdout
    # the step line's last fields (CPU: no peak FLOP/s to divide by)
    assert "| mfu n/a | eta 0s" in proc.stdout
    # Running the same command again resumes from the final checkpoint and has nothing left to do.
    again = subprocess.run(
        [sys.executable, "-m", "keel.launcher.cli", "train", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert again.returncode == 0 and "resumed from step00000300" in again.stdout
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 300
    # keel report: every plot a dense bf16-less run has data for, and the resume at step 300 marked
    report = write_report(tmp_path)
    assert report.drawn == ["loss", "lr", "grad_norm", "throughput", "stragglers", "goodput"]
    # two launches: the run, then the resume with nothing left to do; their start-ups and the gap between
    goodput = json.loads((report.out_dir / "series.json").read_text())["plots"]["goodput"]
    assert goodput["launches"] == 2 and 0.5 < goodput["fraction"] < 1, goodput["lost"]
    assert goodput["lost"]["start-up"] > 0 and goodput["lost"]["between launches"] > 0
    assert "- goodput: " in (tmp_path / "summary.md").read_text()
    series = json.loads((report.out_dir / "series.json").read_text())["plots"]
    assert series["loss"]["resumes"] == [300] and series["loss"]["skipped"] == []
    stragglers = series["stragglers"]
    assert stragglers["slowest"]["step"] == list(range(50, 301, 50))
    manifest = tmp_path / "checkpoints" / "step00000300" / "keel_complete.json"
    world = json.loads(manifest.read_text())["topology"]["world_size"]
    for end in ("slowest", "fastest"):  # a rank of the run's world, each check
        assert set(stragglers[end]["rank"]) <= set(range(world))
    assert all(
        s >= f for s, f in zip(stragglers["slowest"]["value"], stragglers["fastest"]["value"])
    )


def test_runs_in_place_under_torchrun(runs, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "-m",
        "keel.launcher.cli",
        "train",
        "--run-dir",
        str(tmp_path),
        "--ds-config",
        str(REPO / "ds_configs" / "zero2.json"),
    ]
    for item in runs.overrides():
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reference = [r["loss"] for r in read_metrics(runs.get("zero0", 2) / "metrics.jsonl")]
    got = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert got == pytest.approx(reference, rel=1e-5)
