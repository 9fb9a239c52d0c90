"""The multi-stage pipeline schedules reproduce the single-process run, alone and with tensor or Ulysses sequence
parallelism, resume exactly, and take over a 1F1B checkpoint: `parallel.pipeline_schedule: dualpipev` (DeepSpeed's
DualPipeV, two stages per pipeline rank) and `interleaved` (Megatron's interleaved 1F1B on Keel's
`InterleavedModule`/`InterleavedEngine`, `parallel.virtual_stages` per rank)."""

from __future__ import annotations

import pytest

from keel.training.observe.metrics import read_metrics
from tests.keel_runs import Run, copy_run, keel_train
from tests.test_pipeline import PP2_20, column
from tests.test_train_equivalence import assert_close, assert_grad_norms_close

pytestmark = pytest.mark.slow
ZERO1 = "ds_configs/zero1.json"
# type:Block: the `parameters` partition leaves rank 0 only the embedding and the tied head on this tiny model,
# which keel/engine/pipeline_plan.py refuses (DeepSpeed's ZeRO optimizer would hang)
SCHEDULES = {
    name: dict(
        parallel__pp=2, parallel__pipeline_schedule=name, parallel__pipeline_partition="type:Block"
    )
    for name in ("dualpipev", "interleaved")
}
DUALPIPEV = SCHEDULES["dualpipev"]
TP2 = dict(parallel__tp=2, parallel__sequence_parallel="true")
LAYOUTS = {
    "tp2": TP2,
    "sp2": dict(parallel__sp=2),
}  # 4 ranks each; Ulysses sp folds into DeepSpeed's data axis
# interleaved with three chunks per rank: 6 stages need more than the tiny model's 5 layers
DEEP = dict(model__n_layers=4)
V3 = dict(**SCHEDULES["interleaved"], parallel__virtual_stages=3, **DEEP)
KEEL_RUNS = [Run.of("pp1-deep", 1, **DEEP), Run.of("interleaved-v3", 2, ZERO1, **V3)]
for name, schedule in SCHEDULES.items():
    KEEL_RUNS += [
        Run.of(f"{name}-tied{tied}", 2, ZERO1, model__tie_embeddings=tied, **schedule)
        for tied in ("true", "false")
    ]
    KEEL_RUNS += [
        Run.of(f"{name}-{layout}", 4, ZERO1, **schedule, **LAYOUTS[layout]) for layout in LAYOUTS
    ]
    KEEL_RUNS += [
        Run.of(f"{name}-20", 2, ZERO1, **{**PP2_20, **schedule}),
        Run.of(f"{name}-20-resumed", 2, ZERO1, resume_at=10, **{**PP2_20, **schedule}),
    ]
KEEL_RUNS += [Run.of("pp2-20-first-half", 2, ZERO1, **{**PP2_20, "train__exit_after": 10})]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("tied", ["true", "false"])
def test_schedule_matches_pp1(runs, schedule, tied):
    reference = runs.get(f"pp1-tied{tied}", 1, model__tie_embeddings=tied)
    piped = runs.get(
        f"{schedule}-tied{tied}", 2, ZERO1, model__tie_embeddings=tied, **SCHEDULES[schedule]
    )
    assert_close(column(piped, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(piped, "grad_norm"), column(reference, "grad_norm"))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_schedule_with_tp_or_sp_matches_pp1(runs, schedule, layout):
    reference = runs.get("pp1-tiedtrue", 1, model__tie_embeddings="true")
    got = runs.get(f"{schedule}-{layout}", 4, ZERO1, **SCHEDULES[schedule], **LAYOUTS[layout])
    assert_close(column(got, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(got, "grad_norm"), column(reference, "grad_norm"))


def test_interleaved_with_three_chunks_matches_pp1(runs):
    """Each micro-batch goes round the two ranks three times (stages r, r+2, r+4)."""
    reference = runs.get("pp1-deep", 1, **DEEP)
    got = runs.get("interleaved-v3", 2, ZERO1, **V3)
    assert_close(column(got, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(got, "grad_norm"), column(reference, "grad_norm"))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_schedule_resume_is_exact(runs, schedule):
    straight = runs.get(f"{schedule}-20", 2, ZERO1, **{**PP2_20, **SCHEDULES[schedule]})
    resumed = runs.get(
        f"{schedule}-20-resumed", 2, ZERO1, resume_at=10, **{**PP2_20, **SCHEDULES[schedule]}
    )
    assert column(resumed, "loss") == column(straight, "loss")
    assert [r.get("val_loss") for r in read_metrics(resumed / "metrics.jsonl")] == [
        r.get("val_loss") for r in read_metrics(straight / "metrics.jsonl")
    ]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_1f1b_checkpoint_resumes_under_another_schedule(runs, tmp_path, schedule):
    """The layer files are the same; the ZeRO-1 partitions are not (a rank holds other layers), so the
    checkpoint goes through DeepSpeed's universal format, and the run continues as 1F1B would have."""
    straight = runs.get("pp2-20", 2, ZERO1, **PP2_20)
    resumed = copy_run(
        runs.get("pp2-20-first-half", 2, ZERO1, **{**PP2_20, "train__exit_after": 10}),
        tmp_path / "resumed",
    )
    proc = keel_train(resumed, 2, runs.overrides(**{**PP2_20, **SCHEDULES[schedule]}), ZERO1)
    assert "converting to a universal checkpoint" in proc.stdout + proc.stderr
    got, want = read_metrics(resumed / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    assert [r["consumed_samples"] for r in got] == [r["consumed_samples"] for r in want]
    assert_close([r["loss"] for r in got], [r["loss"] for r in want], 1e-5)
