"""The step line's ETA and MFU (keel/training/observe/progress.py), and the line MetricsWriter prints with them."""

from __future__ import annotations

import pytest

from keel.config import load_config
from keel.engine.memory_model import Layout, param_share
from keel.training.observe.metrics import MetricsWriter
from keel.training.observe.progress import (
    Progress,
    flops_per_token,
    format_eta,
    peak_tflops,
    run_progress,
)


def test_peak_comes_from_the_config_or_the_device_table():
    assert peak_tflops("NVIDIA H200", 0.0) == 989.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", 0.0) == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", 0.0) == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", 0.0) == 312.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", 250.0) == 250.0  # logging.peak_tflops wins
    # CPU, unlisted: n/a
    assert peak_tflops(None, 0.0) is None and peak_tflops("Tesla T4", 0.0) is None


def test_flops_per_token_is_6n_plus_attention_and_counts_top_k_experts():
    dense = load_config(None, [])
    m = dense.model
    share = param_share(m, Layout())
    assert share.expert == 0
    assert flops_per_token(m, 256, share.total) == 6 * share.total + 12 * m.n_layers * m.dim * 256
    moe = load_config(None, ["model.moe_experts=4", "model.moe_top_k=2"])
    share = param_share(moe.model, Layout())
    active = share.dense + share.expert * 2 / 4
    assert share.expert > 0
    assert flops_per_token(moe.model, 64, share.total, share.expert) == pytest.approx(
        6 * active + 12 * moe.model.n_layers * moe.model.dim * 64
    )


def test_eta_is_steps_left_times_the_mean_of_the_last_50_steps_wall_time():
    progress = Progress(total_steps=200, flops_per_token=1e6, world_size=2, peak_tflops=None)
    for step in range(1, 61):  # 10 slow steps, then 50 at 0.1 s of step + 0.1 s of checks
        slow = step <= 10
        mfu, eta = progress.update(
            {
                "step": step,
                "tokens_per_s": 1e4,
                "step_time_s": 5.0 if slow else 0.1,
                **({} if slow else {"check_time_s": 0.1}),
            }
        )
    assert mfu is None
    assert eta == pytest.approx(140 * 0.2)  # the slow steps fell out of the window
    assert (
        format_eta(eta) == "28s"
        and format_eta(125) == "2m05s"
        and format_eta(3 * 3600 + 61) == "3h01m"
    )


def test_mfu_divides_model_flops_by_the_world_peak():
    progress = Progress(total_steps=10, flops_per_token=6e9, world_size=8, peak_tflops=989.0)
    mfu, _ = progress.update({"step": 1, "tokens_per_s": 2e5, "step_time_s": 1.0})
    assert mfu == pytest.approx(2e5 * 6e9 / (8 * 989e12))
    assert (
        progress.describe({"step": 2, "tokens_per_s": 2e5, "step_time_s": 1.0})
        == "mfu 15.2% | eta 8s"
    )


def test_step_line_ends_with_mfu_and_eta(tmp_path, capsys):
    cfg = load_config(None, ["train.steps=4"])
    writer = MetricsWriter(
        tmp_path,
        True,
        resumed_step=0,
        log_interval=2,
        total_steps=4,
        progress=run_progress(cfg, 2, "cpu"),
    )
    for step in range(1, 5):
        writer.log(
            {
                "step": step,
                "loss": 5.0,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "tokens_per_s": 1e4,
                "step_time_s": 0.5,
                "skipped": False,
            }
        )
    writer.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("| mfu n/a | eta 1s") and lines[1].endswith("| mfu n/a | eta 0s"), (
        lines
    )
