"""Tensor and sequence parallel training through `keel train` reproduces the single-process run."""

from __future__ import annotations

import pytest
import torch

from keel.training.observe.metrics import read_metrics
from tests.keel_runs import Run
from tests.test_train_equivalence import assert_close, assert_grad_norms_close

pytestmark = pytest.mark.slow
# dropout under SP draws from Keel's sharded stream: the resumed run is exact only if checkpoints carry it
TP2_SP_20 = dict(
    train__steps=20, parallel__tp=2, parallel__sequence_parallel="true", model__dropout=0.1
)
KEEL_RUNS = [
    Run.of("zero0", 1),
    Run.of("tp2", 2, parallel__tp=2),
    Run.of("tp4", 4, parallel__tp=4),
    Run.of("tp2-sp", 2, parallel__tp=2, parallel__sequence_parallel="true"),
    Run.of("tp2-sp-20", 2, "ds_configs/zero1.json", **TP2_SP_20),
    Run.of("tp2-sp-20-resumed", 2, "ds_configs/zero1.json", resume_at=10, **TP2_SP_20),
]
KEEL_RUNS += [
    Run.of(
        f"tp2dp2-zero{stage}",
        4,
        f"ds_configs/zero{stage}.json",
        parallel__tp=2,
        parallel__sequence_parallel="true",
    )
    for stage in (1, 2)
]


def metrics(run_dir):
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_single_process(runs, tp):
    """tp=4 with 2 kv heads also covers replicated kv heads; grad norms prove replicas are counted once."""
    reference = metrics(runs.get("zero0", 1))
    got = metrics(runs.get(f"tp{tp}", tp, parallel__tp=tp))
    assert_close([r["loss"] for r in got], [r["loss"] for r in reference], 1e-5)
    assert_grad_norms_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in reference])


def test_sequence_parallel_matches_plain_tp(runs):
    plain = metrics(runs.get("tp2", 2, parallel__tp=2))
    sp = metrics(runs.get("tp2-sp", 2, parallel__tp=2, parallel__sequence_parallel="true"))
    assert_close([r["loss"] for r in sp], [r["loss"] for r in plain], 1e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_tp2_dp2_with_zero_matches_single_process(runs, stage):
    reference = metrics(runs.get("zero0", 1))
    got = metrics(
        runs.get(
            f"tp2dp2-zero{stage}",
            4,
            f"ds_configs/zero{stage}.json",
            parallel__tp=2,
            parallel__sequence_parallel="true",
        )
    )
    assert_close([r["loss"] for r in got], [r["loss"] for r in reference], 1e-5)
    assert_grad_norms_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in reference])


def _tp_checkpoint_states(run_dir):
    ckpt = run_dir / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    return [
        torch.load(ckpt / tag / f"mp_rank_{r:02d}_model_states.pt", weights_only=False)["module"]
        for r in range(2)
    ]


def test_tp_replicated_parameters_stay_identical_and_resume_is_exact(runs):
    """20 steps of tp=2 with SP and dropout: norm weights (TP-replicated) are bitwise equal on both TP ranks; a
    run stopped at step 10 and resumed (every RNG stream restored, the sequence-parallel dropout one included)
    has the straight run's losses and ends bitwise equal to it."""
    straight = runs.get("tp2-sp-20", 2, "ds_configs/zero1.json", **TP2_SP_20)
    rank0, rank1 = _tp_checkpoint_states(straight)
    replicated = [name for name in rank0 if "norm" in name]
    assert len(replicated) == 2 * 2 + 1  # two norms per block, one final norm
    for name in replicated:
        assert torch.equal(rank0[name], rank1[name]), name
    assert not torch.equal(
        rank0["layers.1.attention.wq.weight"], rank1["layers.1.attention.wq.weight"]
    )

    resumed = runs.get("tp2-sp-20-resumed", 2, "ds_configs/zero1.json", resume_at=10, **TP2_SP_20)
    assert [r["loss"] for r in metrics(resumed)] == [r["loss"] for r in metrics(straight)]
    for a, b in zip(_tp_checkpoint_states(resumed), (rank0, rank1)):
        for name in a:
            assert torch.equal(a[name], b[name]), name
