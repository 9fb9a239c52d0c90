"""`keel report` on a synthetic run dir, in one process: the fp16 loss scale, MoE loads, per-rank step times,
resume and rollback markers, a live run's partial last line, the atomic output, and the one-line errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from keel.launcher.cli import main
from keel.tools.report import INSTALL_HINT, write_report
from tests.report_checks import assert_png_drawn

STEPS = 12


def _record(step: int) -> dict:
    record = {
        "step": step,
        "loss": 8.0 - 0.3 * step,
        "lr": 1e-3 * min(1.0, step / 4),
        "grad_norm": 1.0 + 0.1 * step,
        "skipped": step in (5, 6),
        "loss_scale": 2.0 ** (16 - (step in (5, 6)) - (step >= 6)),
        "tokens_per_s": 1000.0 + 10 * step,
        "step_time_s": 0.5 - 0.01 * step,
        "time": 1000.0 + step,  # the step's end
    }
    # a straggler check on 4 ranks, rank 2 the slowest; the expert-health record of 2 layers
    if step % 4 == 0:
        times = [0.4, 0.41, 0.6 + 0.01 * step, 0.42]
        record.update(
            slowest_rank=2, fastest_rank=0, step_time_max=max(times), step_time_min=min(times)
        )
        record["moe"] = {
            f"L{layer}": {"tokens_per_expert": [10 * step, 20, 30 + layer, 40], "load_entropy": 0.9}
            for layer in (1, 3)
        }
        # FP8 health of 2 blocks (fp8/<block>/<operand>/<stat>): block1's activations degrade at step 8
        for block in (0, 1):
            for operand in "xwg":
                bad = block == 1 and operand == "x" and step >= 8
                record[f"fp8/block{block}/{operand}/underflow"] = 0.7 if bad else 0.001
                record[f"fp8/block{block}/{operand}/saturated"] = 0.0
    if step == 8:
        record["val_loss"] = 5.5
    return record


@pytest.fixture
def live_run(tmp_path: Path) -> Path:
    """Steps 1-12 kept, steps 8-9 of a first attempt discarded by a resume at step 7, a rollback at step 11 to
    step 10, and the run still writing step 13 (its line cut short)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(
        yaml.safe_dump({"train": {"steps": 20}, "stability": {"straggler_interval": 4}})
    )
    lines = [json.dumps(_record(step)) for step in range(1, STEPS + 1)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + json.dumps(_record(13))[:25])
    discarded = [{**_record(8), "loss": 9.5, "skipped": True}, {**_record(9), "loss": 30.0}]
    (run / "metrics.discarded.jsonl").write_text("".join(json.dumps(r) + "\n" for r in discarded))
    events = [
        {"kind": "resume", "step": 7, "rank": 0, "checkpoint": "step00000007"},
        {"kind": "spike", "step": 11, "rank": 0, "action": "rollback", "reason": "loss 9 | 7 σ"},
        {
            "kind": "rollback",
            "step": 11,
            "rank": 0,
            "done": True,
            "to_step": 10,
            "reason": "3 spikes",
        },
        {
            "kind": "fp8_health",
            "step": 8,
            "rank": 0,
            "layer": "block1",
            "operand": "input activations",
            "stat": "underflow",
            "fraction": 0.7,
        },
    ]
    (run / "anomalies.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    # two launches: the first started at t=990 (steps 1-9, the last two lost), the resume at t=1006
    starts = [
        {"event": "start", "time": 1002, "process_started": 990.5, "launched_at": 990.0},
        {"event": "start", "time": 1009, "process_started": 1006.0, "launched_at": 1005.5},
    ]
    for start, first in zip(starts, (1000.5, 1007.6)):
        start.update(first_step_at=first, phases={"imports": 2.0, "restore": 0.0})
    (run / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in starts))
    return run


def test_synthetic_run_draws_every_plot_from_its_records(live_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    # a previous report: replaced as a whole, not merged
    (out / "stale.png").write_bytes(b"an older report")
    (out / "report.md").write_text("# an older report\n")
    main_args = ["report", str(live_run), "--out", str(out)]
    with pytest.raises(SystemExit) as exit_info:
        main(main_args)
    assert exit_info.value.code == 0
    stdout = capsys.readouterr().out
    assert (
        "9 plot(s) (loss, lr, grad_norm, loss_scale, throughput, stragglers, experts, fp8, goodput)"
        in stdout
    )
    assert "left out of metrics.jsonl: a partial last line (still being written)" in stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            f"{n}.png"
            for n in (
                "loss",
                "lr",
                "grad_norm",
                "loss_scale",
                "throughput",
                "stragglers",
                "experts",
                "fp8",
                "goodput",
            )
        ]
        + ["report.md", "series.json"]
    )
    assert [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".")
    ] == []  # no staging dir left behind
    for png in out.glob("*.png"):
        assert_png_drawn(png)

    series = json.loads((out / "series.json").read_text())
    plots = series["plots"]
    assert series["skipped"] == {} and series["left_out"] == {
        "metrics.jsonl": "a partial last line (still being written)"
    }
    loss = plots["loss"]
    assert loss["train"]["step"] == list(range(1, STEPS + 1))  # the partial step 13: left out
    assert loss["train"]["value"] == pytest.approx([8.0 - 0.3 * s for s in loss["train"]["step"]])
    assert [(m["step"], m["rolled_back"]) for m in loss["skipped"]] == [
        (5, False),
        (6, False),
        (8, True),
    ]
    assert loss["rolled_back"] == {"step": [8, 9], "value": [9.5, 30.0]}
    assert loss["rollbacks"] == [{"step": 11, "to_step": 10}] and loss["resumes"] == [7]
    assert loss["val"] == {"step": [8], "value": [5.5]}
    scale = plots["loss_scale"]
    assert scale["loss_scale"]["value"] == [2.0**16] * 4 + [2.0**15, 2.0**14] + [2.0**15] * 6
    assert scale["skipped"] == [5, 6]
    slowest, fastest = plots["stragglers"]["slowest"], plots["stragglers"]["fastest"]
    assert slowest["step"] == fastest["step"] == [4, 8, 12]
    assert slowest["value"] == pytest.approx([0.64, 0.68, 0.72]) and slowest["rank"] == [2, 2, 2]
    assert fastest["value"] == pytest.approx([0.4] * 3) and fastest["rank"] == [0, 0, 0]
    experts = plots["experts"]["layers"]
    assert list(experts) == ["L1", "L3"] and experts["L3"]["step"] == [4, 8, 12]
    assert experts["L3"]["share"][0] == pytest.approx([40 / 133, 20 / 133, 33 / 133, 40 / 133])
    fp8 = plots["fp8"]
    assert list(fp8["underflow"]) == ["input activations", "weights", "output gradients"]
    assert fp8["underflow"]["input activations"]["block1"] == {
        "step": [4, 8, 12],
        "value": [0.001, 0.7, 0.7],
    }
    assert fp8["warned"] == [{"step": 8, "layer": "block1", "operand": "input activations"}]
    assert plots["throughput"]["tokens_per_s"]["value"] == [
        1000.0 + 10 * s for s in range(1, STEPS + 1)
    ]

    report = (out / "report.md").read_text()
    assert "- status: at step 12 of 20 (still running, or stopped: see summary.md)" in report
    assert "- skipped steps: 3: 5, 6, 8 (rolled back)" in report
    assert "- rollbacks: 1: step 11 → 10" in report and "- resumes: 1: at step 7" in report
    assert "- left out of metrics.jsonl: a partial last line (still being written)" in report
    assert "| 11 | rollback | 0 | done=True; to_step=10; reason=3 spikes |" in report
    # a "|" escaped in its cell
    assert "| 11 | spike | 0 | action=rollback; reason=loss 9 \\| 7 σ |" in report
    for name in plots:
        assert f"![{name}]({name}.png)" in report
    assert "Plots skipped" not in report


def test_a_plot_without_data_is_skipped_with_its_reason(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(
        yaml.safe_dump({"train": {"steps": 3}, "stability": {"straggler_interval": 50}})
    )
    records = [
        {
            "step": s,
            "loss": 5.0 - s,
            "lr": 1e-3,
            "grad_norm": None,
            "skipped": False,
            "loss_scale": None,
            "tokens_per_s": 900.0 + s,
            "step_time_s": 0.3,
        }
        for s in (1, 2, 3)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = write_report(run)
    assert report.out_dir == run / "report" and report.drawn == ["loss", "lr", "throughput"]
    assert set(report.skipped) == {
        "grad_norm",
        "loss_scale",
        "stragglers",
        "experts",
        "fp8",
        "goodput",
    }
    text = (run / "report" / "report.md").read_text()
    assert "- status: finished" in text and "## Anomalies\n\nnone" in text
    assert (
        "- Slowest and fastest rank (`stragglers.png`): no straggler check in the run yet "
        "(stability.straggler_interval=50;"
    ) in text
    assert "- fp16 loss scale (`loss_scale.png`): no loss scale recorded: not an fp16 run" in text
    assert not (run / "report" / "loss_scale.png").exists()


def test_errors_are_one_line_with_exit_2(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    for target, out, message in (
        (tmp_path / "missing", [], "is not a directory"),
        (tmp_path / "notes", [], "is not a keel run dir"),
        (run, ["--out", str(run)], "would replace the run dir"),
        (run, ["--out", str(tmp_path)], "would replace the run dir"),
        (run, ["--out", str(tmp_path / "notes")], "holds files but no report.md"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["report", str(target), *out])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me" and (
        run / "checkpoints"
    ).is_dir()
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(run)])
    assert exit_info.value.code == 2 and capsys.readouterr().err == f"keel: error: {INSTALL_HINT}\n"
    assert "pip install 'keel[plot]'" in INSTALL_HINT
