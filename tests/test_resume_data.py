"""Resuming on data that orders the samples differently is refused before any rank starts (keel/launcher/
resume_data.py): another corpus, other blend weights, another data.seq_len, data.val_fraction or train.seed each
named with old and new value, exit 2; `data.allow_change_on_resume: true` lets it through with a warning.

One process: the pre-launch path (`build_run` + `prepare_data`, and `keel train`'s own `main` for the exit code)
on a run dir whose `checkpoints/latest` exists — what the check looks at; no rank is started.
"""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import pytest

from keel.config import ConfigError
from keel.launcher.cli import main
from keel.launcher.run_spec import build_run, prepare_data, write_run_dir

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _blend(weights: tuple[float, float]) -> str:
    return json.dumps(
        [
            {"path": str(STDLIB / "json" / "*.py"), "weight": weights[0]},
            {
                "path": [str(STDLIB / "email" / "*.py"), str(STDLIB / "http" / "*.py")],
                "weight": weights[1],
            },
        ]
    )


def _resumable(run: Path, overrides: list[str]) -> Path:
    """A run dir as a stopped run leaves it: its resolved config and data.json, and a latest checkpoint."""
    spec = build_run(None, overrides, None, str(run), 1)
    prepare_data(spec)
    write_run_dir(spec)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("step00000010")
    return run


def _prepared(overrides: list[str], run: Path):
    spec = build_run(None, overrides, None, str(run), 1)
    prepare_data(spec)
    return spec


@pytest.mark.fault(
    "resume with other seq_len, val_fraction or seed", "refused naming each change; exit 2"
)
def test_changed_order_settings_are_refused_in_one_line_naming_each(runs, tmp_path, capsys):
    run = _resumable(tmp_path / "run", runs.overrides())
    recorded = {name: (run / name).read_bytes() for name in ("config.yaml", "data.json")}
    # these keep the order
    _prepared(runs.overrides(train__steps=20, data__skip_ranges='["8:16"]'), run)
    args = ["train", "--nproc", "2", "--run-dir", str(run)]
    for item in runs.overrides(data__seq_len=64, data__val_fraction=0.05, train__seed=7):
        args += ["--set", item]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1, errors
    assert errors[0].startswith(
        f"keel: error: data: the checkpoints in {run} count samples in the order of their "
        "data, and this run changes it: data.seq_len 32 → 64; data.val_fraction 0.01 → "
        "0.05; train.seed 1234 → 7; resuming would continue"
    ), errors[0]
    assert "data.allow_change_on_resume=true" in errors[0]
    assert {
        name: (run / name).read_bytes() for name in recorded
    } == recorded  # nothing written, no rank started
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoints",
        "config.yaml",
        "data.json",
        "ds_config.json",
        "run_id.txt",
    ]


@pytest.mark.fault(
    "resume a checkpoint counted in the old sample order",
    "refused naming the order change; exit 2",
)
def test_a_checkpoint_of_the_old_sample_order_is_refused(runs, tmp_path, capsys):
    """Runs before data.json recorded `sample_order` drew each epoch from numpy's permutation: their sample
    count indexes that order, not Keel's own."""
    run = _resumable(tmp_path / "run", runs.overrides())
    data = json.loads((run / "data.json").read_text())
    assert data.pop("sample_order") == "feistel-v1"
    (run / "data.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"the sample order numpy-permutation → feistel-v1"):
        _prepared(runs.overrides(), run)
    _prepared(runs.overrides(data__allow_change_on_resume="true"), run)  # a deliberate change
    assert "the sample order numpy-permutation → feistel-v1" in capsys.readouterr().err


@pytest.mark.fault(
    "resume on another corpus", "refused naming old and new corpus and sizes; exit 2"
)
def test_another_corpus_is_named_with_its_sizes(runs, tmp_path, small_corpus):
    """A trained tokenizer changes with the corpus: that is refused first, naming the old tokenizer to give; given
    it, the corpus change itself is named, with both corpora's sizes."""
    run = _resumable(tmp_path / "run", runs.overrides())
    old = json.loads((run / "data.json").read_text())
    fewer = json.dumps(small_corpus[:2])
    with pytest.raises(
        ConfigError, match=f"give the old one, data.tokenizer={re.escape(old['tokenizer'])}, or"
    ):
        _prepared(runs.overrides(data__corpus=fewer), run)
    given = runs.overrides(data__corpus=fewer, data__tokenizer=old["tokenizer"])
    with pytest.raises(ConfigError) as err:
        _prepared(given, run)
    new = _prepared(given + ["checkpoint.resume=false"], run).data
    assert str(err.value).split(": ")[2].split("; resuming")[0] == (
        f"data.corpus {json.dumps(small_corpus)} ({old['num_tokens']:,} tokens in {old['num_docs']:,} documents) → "
        f"{fewer} ({new['num_tokens']:,} tokens in {new['num_docs']:,} documents)"
    )
    _prepared(given + ["data.allow_change_on_resume=true"], run)


@pytest.mark.fault(
    "resume with other blend weights", "refused, or warned with allow_change_on_resume"
)
def test_other_blend_weights_are_refused_unless_allowed(runs, tmp_path, capsys):
    run = _resumable(tmp_path / "run", runs.overrides(data__corpus=_blend((0.7, 0.3))))
    with pytest.raises(
        ConfigError, match=r"this run changes it: data.corpus weights \[0.7, 0.3\] → \[0.5, 0.5\]; "
    ):
        _prepared(runs.overrides(data__corpus=_blend((1, 1))), run)
    capsys.readouterr()
    spec = _prepared(
        runs.overrides(data__corpus=_blend((1, 1)), data__allow_change_on_resume=True), run
    )
    assert [s["weight"] for s in spec.data["sources"]] == [0.5, 0.5]
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"keel: warning: resuming {run} on changed data (data.allow_change_on_resume): data.corpus weights "
        "[0.7, 0.3] → [0.5, 0.5]; its sample count now indexes the new order"
    )
    # the same normalized weights resume
    _prepared(runs.overrides(data__corpus=_blend((7, 3))), run)
