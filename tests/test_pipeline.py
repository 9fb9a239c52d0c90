"""Pipeline parallel (DeepSpeed's pipeline engine) reproduces the single-process run."""

from __future__ import annotations

import pytest
import torch

from keel.training.observe.metrics import read_metrics
from tests.keel_runs import Run
from tests.test_train_equivalence import assert_close, assert_grad_norms_close

pytestmark = pytest.mark.slow
PP2_20 = dict(train__steps=20, parallel__pp=2, train__eval_interval=5)
KEEL_RUNS = [
    Run.of(
        "pp2tp2dp2",
        8,
        "ds_configs/zero1.json",
        parallel__pp=2,
        parallel__tp=2,
        parallel__sequence_parallel="true",
    ),
    Run.of("pp2-20", 2, "ds_configs/zero1.json", **PP2_20),
    Run.of("pp2-20-resumed", 2, "ds_configs/zero1.json", resume_at=10, **PP2_20),
]
# Ulysses sp inside pipeline stages (DeepSpeed's data axis holds the sp ranks): with data parallel, and with tp
PP_SP = {
    "pp2sp2dp2": dict(parallel__pp=2, parallel__sp=2),
    "pp2tp2sp2": dict(
        parallel__pp=2, parallel__tp=2, parallel__sp=2, parallel__sequence_parallel="true"
    ),
}
KEEL_RUNS += [Run.of(name, 8, "ds_configs/zero1.json", **layout) for name, layout in PP_SP.items()]
KEEL_RUNS += [
    Run.of(
        f"pp{pp}-tied{tied}",
        pp,
        **({"parallel__pp": 2} if pp == 2 else {}),
        model__tie_embeddings=tied,
    )
    for pp in (1, 2)
    for tied in ("true", "false")
]
KEEL_RUNS += [
    Run.of(
        f"ckpt-{on}-pp{pp}",
        pp,
        parallel__pp=pp,
        **({"train__activation_checkpoint_interval": 1} if on == "on" else {}),
    )
    for pp in (1, 2)
    for on in ("off", "on")
]


def column(run_dir, key):
    return [r[key] for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("tied", ["true", "false"])
def test_pp2_matches_pp1(runs, tied):
    reference = runs.get(f"pp1-tied{tied}", 1, model__tie_embeddings=tied)
    piped = runs.get(f"pp2-tied{tied}", 2, parallel__pp=2, model__tie_embeddings=tied)
    assert_close(column(piped, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(piped, "grad_norm"), column(reference, "grad_norm"))


def test_3d_pp2_tp2_dp2_matches_single_process(runs):
    reference = runs.get("pp1-tiedtrue", 1, model__tie_embeddings="true")
    three_d = runs.get(
        "pp2tp2dp2",
        8,
        "ds_configs/zero1.json",
        parallel__pp=2,
        parallel__tp=2,
        parallel__sequence_parallel="true",
    )
    assert_close(column(three_d, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(three_d, "grad_norm"), column(reference, "grad_norm"))


@pytest.mark.parametrize("layout", sorted(PP_SP))
def test_ulysses_inside_pipeline_stages_matches_single_process(runs, layout):
    reference = runs.get("pp1-tiedtrue", 1, model__tie_embeddings="true")
    got = runs.get(layout, 8, "ds_configs/zero1.json", **PP_SP[layout])
    assert_close(column(got, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(got, "grad_norm"), column(reference, "grad_norm"))


@pytest.mark.parametrize("pp", [1, 2])
def test_activation_checkpointing_changes_nothing(runs, pp):
    """Recomputing activations gives the same losses and gradients (grad norms, and the final weights)."""
    plain = runs.get(f"ckpt-off-pp{pp}", pp, parallel__pp=pp)
    recomputed = runs.get(
        f"ckpt-on-pp{pp}", pp, parallel__pp=pp, train__activation_checkpoint_interval=1
    )
    assert column(recomputed, "loss") == pytest.approx(column(plain, "loss"), rel=1e-6)
    assert column(recomputed, "grad_norm") == pytest.approx(column(plain, "grad_norm"), rel=1e-6)


def _layer_states(run_dir):
    ckpt = run_dir / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    return {
        p.name: torch.load(p, weights_only=False)
        for p in sorted((ckpt / tag).glob("layer_*-model_states.pt"))
    }


def test_pipeline_resume_is_exact(runs):
    straight = runs.get("pp2-20", 2, "ds_configs/zero1.json", **PP2_20)
    resumed = runs.get("pp2-20-resumed", 2, "ds_configs/zero1.json", resume_at=10, **PP2_20)
    assert column(resumed, "loss") == column(straight, "loss")
    assert [r.get("val_loss") for r in read_metrics(resumed / "metrics.jsonl")] == [
        r.get("val_loss") for r in read_metrics(straight / "metrics.jsonl")
    ]
    a, b = _layer_states(resumed), _layer_states(straight)
    # embedding, 2 blocks, final norm (the tied head is the embedding)
    assert a.keys() == b.keys() and len(a) == 4
    for name in a:
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), (name, key)


def test_pipeline_refuses_zero2(runs, tmp_path):
    import subprocess
    import sys

    from tests.keel_runs import REPO

    cmd = [
        sys.executable,
        "-m",
        "keel.launcher.cli",
        "train",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path),
        "--ds-config",
        str(REPO / "ds_configs" / "zero2.json"),
        "--set",
        "parallel.pp=2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "supports ZeRO 0 and 1 only" in proc.stderr
