"""Context parallel (`parallel.cp`) in real `keel train` runs (gloo): every layout it composes with reproduces the
single-process run — losses at 1e-5 and gradient norms as tests/test_train_equivalence.py holds them — and a cp run
resumes bitwise, and at another cp.

The layouts: cp4 alone, cp2 alone under ZeRO-3; cp2 × Ulysses sp2 (2-D sequence parallelism); cp2 × tp2 with
Megatron SP; cp2 × pp2 (1F1B and interleaved); cp2 × dp2 with ep2 experts; cp2 with document masking on packed
documents. The model, layer by layer with real document splits, is in tests/test_context_parallel.py.
"""

from __future__ import annotations

import pytest

from keel.training.observe.metrics import read_metrics
from tests.keel_runs import Run, assert_same_weights, copy_run, keel_train, losses
from tests.test_blend_run import CHANGES as PACKED_DOCUMENTS
from tests.test_moe_training import MOE
from tests.test_pipeline import column
from tests.test_train_equivalence import assert_close, assert_grad_norms_close

pytestmark = pytest.mark.slow
ZERO1 = "ds_configs/zero1.json"
CP2 = dict(parallel__cp=2)
# the traced layouts also serve tests/test_collective_trace.py (tracing changes no numerics)
CP2_SP2 = dict(parallel__cp=2, parallel__sp=2, logging__collective_trace="true")
CP2_EP2 = dict(MOE, parallel__cp=2, parallel__ep=2, logging__collective_trace="true")
# (world, DeepSpeed config, changes) per layout; each against the one-process run of its model
# (cp2 alone is the ZeRO-3 run: ZeRO-3 gives ZeRO-0's losses, tests/test_train_equivalence.py)
LAYOUTS = {
    "cp4": (4, "ds_configs/zero0.json", dict(parallel__cp=4)),
    "cp2sp2": (4, ZERO1, CP2_SP2),
    "cp2tp2sp": (4, ZERO1, dict(CP2, parallel__tp=2, parallel__sequence_parallel="true")),
    "cp2pp2": (4, ZERO1, dict(CP2, parallel__pp=2)),
    "cp2pp2-interleaved": (
        4,
        ZERO1,
        dict(
            CP2,
            parallel__pp=2,
            parallel__pipeline_schedule="interleaved",
            parallel__pipeline_partition="type:Block",
        ),
    ),
    "cp2-zero3": (2, "ds_configs/zero3.json", CP2),
    "cp2ep2": (4, ZERO1, CP2_EP2),
}
REFERENCES = {"cp2ep2": ("moe-single", MOE)}
STEPS_20 = dict(CP2, train__steps=20)
FIRST_HALF = dict(train__steps=20, train__exit_after=10)
KEEL_RUNS = [Run.of(name, world, ds, **changes) for name, (world, ds, changes) in LAYOUTS.items()]
KEEL_RUNS += [
    Run.of("cp2-documents", 2, **CP2, **PACKED_DOCUMENTS),
    Run.of("cp2-20", 2, ZERO1, **STEPS_20),
    Run.of("cp2-20-resumed", 2, ZERO1, resume_at=10, **STEPS_20),
    Run.of("cp4-20-first-half", 4, ZERO1, parallel__cp=4, **FIRST_HALF),
]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_matches_one_process(runs, layout):
    world, ds, changes = LAYOUTS[layout]
    name, model = REFERENCES.get(layout, ("zero0", {}))
    reference = runs.get(name, 1, **model)
    got = runs.get(layout, world, ds, **changes)
    assert_close(column(got, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(got, "grad_norm"), column(reference, "grad_norm"))


def test_context_parallel_with_document_masking_matches_one_process(runs):
    reference = runs.get("blend-whole", 1, **PACKED_DOCUMENTS)
    got = runs.get("cp2-documents", 2, **CP2, **PACKED_DOCUMENTS)
    assert_close(column(got, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(got, "grad_norm"), column(reference, "grad_norm"))


def test_context_parallel_resume_is_exact(runs):
    straight = runs.get("cp2-20", 2, ZERO1, **STEPS_20)
    resumed = runs.get("cp2-20-resumed", 2, ZERO1, resume_at=10, **STEPS_20)
    assert losses(resumed) == losses(straight)  # bitwise: same floats
    assert_same_weights(resumed, straight)


def test_a_cp4_checkpoint_resumes_at_cp2(runs, tmp_path):
    """Written by cp4 on 4 ranks, continued by cp2 × dp2 on the same 4: the parameters are replicated over cp, the
    ZeRO partitions span the same 4 ranks, and the data position carries over (dp 1 → 2). The continuation is the
    straight 20-step run's (cp and dp split the same samples)."""
    straight = runs.get("zero1-20", 2, ZERO1, train__steps=20)
    resumed = copy_run(
        runs.get("cp4-20-first-half", 4, ZERO1, parallel__cp=4, **FIRST_HALF),
        tmp_path / "resumed",
    )
    keel_train(resumed, 4, runs.overrides(train__steps=20, parallel__cp=2), ZERO1)
    got, want = read_metrics(resumed / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    assert [r["consumed_samples"] for r in got] == [r["consumed_samples"] for r in want]
    assert_close([r["loss"] for r in got], [r["loss"] for r in want], 1e-5)
