"""`parallel.pipeline_schedule: dualpipev` (DeepSpeed's DualPipeV: two stages per pipeline rank) reproduces the
single-process run, alone and with tensor or Ulysses sequence parallelism, resumes exactly, and takes over a 1F1B
checkpoint."""

from __future__ import annotations

import pytest

from keel.training.metrics import read_metrics
from tests.keel_runs import Run, copy_run, keel_train
from tests.test_pipeline import PP2_20, column
from tests.test_train_equivalence import assert_close, assert_grad_norms_close

pytestmark = pytest.mark.slow
ZERO1 = "ds_configs/zero1.json"
# type:Block: the `parameters` partition leaves rank 0 only the embedding and the tied head on this tiny model,
# which keel/training/pipeline_plan.py refuses (DeepSpeed's ZeRO optimizer would hang)
DUALPIPEV = dict(parallel__pp=2, parallel__pipeline_schedule="dualpipev", parallel__pipeline_partition="type:Block")
TP2 = dict(parallel__tp=2, parallel__sequence_parallel="true")
DUALPIPEV_20 = {**PP2_20, **DUALPIPEV}
KEEL_RUNS = [Run.of(f"dualpipev-tied{tied}", 2, ZERO1, model__tie_embeddings=tied, **DUALPIPEV)
             for tied in ("true", "false")]
LAYOUTS = {"tp2": TP2, "sp2": dict(parallel__sp=2)}  # 4 ranks each; Ulysses sp folds into DeepSpeed's data axis
KEEL_RUNS += [Run.of(f"dualpipev-{name}", 4, ZERO1, **DUALPIPEV, **layout) for name, layout in LAYOUTS.items()]
KEEL_RUNS += [
              Run.of("dualpipev-20", 2, ZERO1, **DUALPIPEV_20),
              Run.of("dualpipev-20-resumed", 2, ZERO1, resume_at=10, **DUALPIPEV_20),
              Run.of("pp2-20-first-half", 2, ZERO1, **{**PP2_20, "train__exit_after": 10})]


@pytest.mark.parametrize("tied", ["true", "false"])
def test_dualpipev_matches_pp1(runs, tied):
    reference = runs.get(f"pp1-tied{tied}", 1, model__tie_embeddings=tied)
    piped = runs.get(f"dualpipev-tied{tied}", 2, ZERO1, model__tie_embeddings=tied, **DUALPIPEV)
    assert_close(column(piped, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(piped, "grad_norm"), column(reference, "grad_norm"))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dualpipev_with_tp_or_sp_matches_pp1(runs, layout):
    reference = runs.get("pp1-tiedtrue", 1, model__tie_embeddings="true")
    got = runs.get(f"dualpipev-{layout}", 4, ZERO1, **DUALPIPEV, **LAYOUTS[layout])
    assert_close(column(got, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(got, "grad_norm"), column(reference, "grad_norm"))


def test_dualpipev_resume_is_exact(runs):
    straight = runs.get("dualpipev-20", 2, ZERO1, **DUALPIPEV_20)
    resumed = runs.get("dualpipev-20-resumed", 2, ZERO1, resume_at=10, **DUALPIPEV_20)
    assert column(resumed, "loss") == column(straight, "loss")
    assert [r.get("val_loss") for r in read_metrics(resumed / "metrics.jsonl")] == \
        [r.get("val_loss") for r in read_metrics(straight / "metrics.jsonl")]


def test_a_1f1b_checkpoint_resumes_under_dualpipev(runs, tmp_path):
    """The layer files are the same; the ZeRO-1 partitions are not (a rank holds other layers), so the
    checkpoint goes through DeepSpeed's universal format, and the run continues as 1F1B would have."""
    straight = runs.get("pp2-20", 2, ZERO1, **PP2_20)
    resumed = copy_run(runs.get("pp2-20-first-half", 2, ZERO1, **{**PP2_20, "train__exit_after": 10}),
                       tmp_path / "resumed")
    proc = keel_train(resumed, 2, runs.overrides(**DUALPIPEV_20), ZERO1)
    assert "converting to a universal checkpoint" in proc.stdout + proc.stderr
    got, want = read_metrics(resumed / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    assert [r["consumed_samples"] for r in got] == [r["consumed_samples"] for r in want]
    assert_close([r["loss"] for r in got], [r["loss"] for r in want], 1e-5)
