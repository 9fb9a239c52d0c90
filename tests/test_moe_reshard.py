"""An MoE run resumes on another data/expert-parallel layout: experts and their Adam state move to the ranks that
hold them now (keel/training/moe_reshard.py), and training continues as if uninterrupted."""

from __future__ import annotations

import pytest

from keel.training.metrics import read_metrics
from tests.keel_runs import Run, copy_run, keel_train
from tests.test_train_equivalence import assert_close

pytestmark = pytest.mark.slow
MOE = dict(model__moe_experts=4, parallel__ep=2, train__steps=20)
KEEL_RUNS = [Run.of("moe-ep2edp2-20", 4, "ds_configs/zero1.json", **MOE),
             Run.of("moe-ep2edp2-first-half", 4, "ds_configs/zero1.json", train__exit_after=10, **MOE)]


def _records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}


@pytest.mark.fault("a node lost under an MoE run (4 ranks ep2 x edp2 resume on 2: ep2 x edp1, ep1 x edp2)",
                   "experts and their Adam state converted to the new layout; the run continues as uninterrupted")
@pytest.mark.parametrize("ep", [2, 1])
def test_moe_resumes_on_fewer_ranks_and_another_ep(runs, tmp_path, ep):
    straight = _records(runs.get("moe-ep2edp2-20", 4, "ds_configs/zero1.json", **MOE))
    first = runs.get("moe-ep2edp2-first-half", 4, "ds_configs/zero1.json", train__exit_after=10, **MOE)
    resumed = copy_run(first, tmp_path / "resumed")
    proc = keel_train(resumed, 2, runs.overrides(**{**MOE, "parallel__ep": ep}), "ds_configs/zero1.json")
    assert "converting to a universal checkpoint" in proc.stdout + proc.stderr
    got = _records(resumed)
    assert sorted(got) == list(range(1, 21))
    assert [got[s]["consumed_samples"] for s in range(11, 21)] == [straight[s]["consumed_samples"]
                                                                    for s in range(11, 21)]
    assert_close([got[s]["loss"] for s in range(11, 21)], [straight[s]["loss"] for s in range(11, 21)], 1e-5)
    converted = resumed / "checkpoints" / "step00000010" / "universal_moe" / f"ep{ep}"
    assert sorted(p.name for p in converted.iterdir()) == [f"tp0_ep{e}" for e in range(ep)]
