"""LR schedules, batch-size ramp-up, schedule validation, and the `keel lr-find` range test."""

from __future__ import annotations

import csv
import importlib.util
import math
import re
import subprocess
import sys

import pytest
import torch

from keel.config import LR_SCHEDULES, RAMPUP_SCALINGS, ConfigError, TrainConfig, validate_schedule
from keel.engine.lr_schedule import (
    AFTER_WARMUP,
    RAMPUP_LR_FACTORS,
    build_scheduler,
    lr_multiplier,
    rampup_batch_size,
    rampup_lr_factor,
    refresh_lr,
    samples_before_step,
)
from keel.launcher.cli import build_parser, cmd_lr_find
from keel.tools.lr_find import range_test, steepest_descent_index, sweep_lrs, write_csv, write_plot
from tests.keel_runs import REPO


def curve(cfg: TrainConfig, steps: int | None = None) -> list[float]:
    return [lr_multiplier(s, cfg) for s in range(steps if steps is not None else cfg.steps + 1)]


# -- schedule shapes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "inverse_sqrt", "wsd"])
def test_every_schedule_warms_up_linearly_to_one(schedule):
    cfg = TrainConfig(steps=100, warmup_steps=8, lr_schedule=schedule, min_lr_ratio=0.1)
    assert curve(cfg, 8) == pytest.approx([(s + 1) / 8 for s in range(8)])
    assert lr_multiplier(7, cfg) == pytest.approx(1.0)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "inverse_sqrt", "wsd"])
def test_decaying_schedules_are_continuous_monotonic_and_floored(schedule):
    cfg = TrainConfig(
        steps=1000, warmup_steps=10, lr_schedule=schedule, min_lr_ratio=0.05, decay_fraction=0.3
    )
    values = curve(cfg, 5000)  # far past the end: inverse_sqrt meets its floor at step 3999
    after = values[9:]  # from the last warmup step (multiplier 1.0) on
    assert all(b <= a + 1e-12 for a, b in zip(after, after[1:])), "must not increase after warmup"
    assert max(abs(b - a) for a, b in zip(values, values[1:])) < 0.11, (
        "no jumps (warmup steps are 0.1)"
    )
    assert min(values[10:]) >= 0.05 - 1e-12
    assert values[-1] == pytest.approx(0.05)


def test_inverse_sqrt_is_noam():
    cfg = TrainConfig(steps=1000, warmup_steps=16, lr_schedule="inverse_sqrt", min_lr_ratio=0.0)
    for step in (0, 7, 15, 16, 63, 255, 999):
        n = step + 1
        assert lr_multiplier(step, cfg) == pytest.approx(min(n / 16, math.sqrt(16 / n)))
    assert lr_multiplier(63, cfg) == pytest.approx(0.5)  # sqrt(16/64)
    assert lr_multiplier(16 * 100 - 1, cfg) == pytest.approx(0.1)


def test_inverse_sqrt_floor_and_zero_warmup():
    floored = TrainConfig(steps=10, warmup_steps=4, lr_schedule="inverse_sqrt", min_lr_ratio=0.25)
    # sqrt(4/64) = 0.25 exactly at the floor
    assert lr_multiplier(63, floored) == pytest.approx(0.25)
    assert lr_multiplier(10_000, floored) == pytest.approx(0.25)
    no_warmup = TrainConfig(steps=10, warmup_steps=0, lr_schedule="inverse_sqrt", min_lr_ratio=0.0)
    assert [lr_multiplier(s, no_warmup) for s in (0, 3, 99)] == pytest.approx([1.0, 0.5, 0.1])


def test_wsd_stable_then_one_minus_sqrt_decay():
    cfg = TrainConfig(
        steps=100, warmup_steps=10, lr_schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.1
    )
    assert curve(cfg, 81)[9:] == pytest.approx([1.0] * 72), "stable through the decay's first step"
    for step in (80, 85, 90, 99, 100):
        progress = (step - 80) / 20
        assert lr_multiplier(step, cfg) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(progress)))
    assert lr_multiplier(81, cfg) < 1.0 and lr_multiplier(150, cfg) == pytest.approx(0.1)


def test_wsd_decay_never_starts_inside_warmup():
    cfg = TrainConfig(
        steps=20, warmup_steps=15, lr_schedule="wsd", decay_fraction=0.5, min_lr_ratio=0.0
    )
    values = curve(cfg)
    # decay starts at 15, not 10
    assert values[14] == pytest.approx(1.0) and values[15] == pytest.approx(1.0)
    assert values[20] == pytest.approx(0.0)
    assert all(b < a for a, b in zip(values[15:], values[16:]))


def test_unknown_schedule_raises():
    """A TrainConfig that never went through validation gets the config's own one-line error, not a KeyError."""
    with pytest.raises(
        ConfigError, match=r"^train\.lr_schedule: expected cosine, linear, constant"
    ):
        lr_multiplier(50, TrainConfig(steps=100, warmup_steps=0, lr_schedule="step"))
    with pytest.raises(ConfigError, match=r"^train\.rampup_lr_scaling: expected one of"):
        rampup_lr_factor(
            0, TrainConfig(rampup_start_batch=8, rampup_steps=4, rampup_lr_scaling="cubic")
        )


def test_dispatch_tables_cover_exactly_the_names_the_config_admits():
    assert set(AFTER_WARMUP) == set(LR_SCHEDULES)
    assert set(RAMPUP_LR_FACTORS) == set(RAMPUP_SCALINGS)


# -- batch-size ramp-up ---------------------------------------------------------------------------------------
RAMP = dict(
    global_batch_size=96, micro_batch_size=2, rampup_start_batch=8, rampup_steps=37, steps=100
)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_rampup_batches_are_split_evenly_and_reach_the_global_batch(dp):
    cfg = TrainConfig(**RAMP)
    unit = cfg.micro_batch_size * dp
    batches = [rampup_batch_size(s, cfg, dp) for s in range(60)]
    assert batches[0] == 8
    assert all(b % unit == 0 and b >= unit for b in batches)
    assert all(b >= a for a, b in zip(batches, batches[1:])), "never shrinks"
    assert all(b < 96 for b in batches[:37]) and all(b == 96 for b in batches[37:])
    for s in range(37):  # rounded down from the linear ramp, by less than one unit
        exact = 8 + (96 - 8) * s / 37
        assert exact - unit < batches[s] <= exact + 1e-9


def test_rampup_off_is_the_global_batch():
    cfg = TrainConfig(
        global_batch_size=16, micro_batch_size=4, rampup_start_batch=0, rampup_steps=50
    )
    assert {rampup_batch_size(s, cfg, 2) for s in range(100)} == {16}
    assert samples_before_step(7, cfg, 2) == 7 * 16
    assert rampup_lr_factor(0, cfg) == 1.0


@pytest.mark.parametrize(
    "params",
    [
        RAMP,
        # jumps several units
        dict(global_batch_size=64, micro_batch_size=4, rampup_start_batch=8, rampup_steps=5),
        # long plateaus
        dict(global_batch_size=1024, micro_batch_size=8, rampup_start_batch=16, rampup_steps=300),
        dict(global_batch_size=12, micro_batch_size=1, rampup_start_batch=4, rampup_steps=1),
    ],
)
@pytest.mark.parametrize("dp", [1, 2])
def test_samples_before_step_is_the_cumulative_sum(params, dp):
    cfg = TrainConfig(**params)
    validate_schedule(cfg, dp)
    total = 0
    for step in range(cfg.rampup_steps + 20):
        assert samples_before_step(step, cfg, dp) == total, f"step {step}"
        total += rampup_batch_size(step, cfg, dp)


def test_rampup_lr_factor_linear_sqrt_none():
    cfg = TrainConfig(
        global_batch_size=64, micro_batch_size=4, rampup_start_batch=16, rampup_steps=12
    )
    assert rampup_batch_size(0, cfg) == 16
    assert rampup_lr_factor(
        0, TrainConfig(**{**vars(cfg), "rampup_lr_scaling": "linear"})
    ) == pytest.approx(0.25)
    assert rampup_lr_factor(
        0, TrainConfig(**{**vars(cfg), "rampup_lr_scaling": "sqrt"})
    ) == pytest.approx(0.5)
    assert rampup_lr_factor(0, TrainConfig(**{**vars(cfg), "rampup_lr_scaling": "none"})) == 1.0
    assert rampup_batch_size(6, cfg) == 40
    assert rampup_lr_factor(
        6, TrainConfig(**{**vars(cfg), "rampup_lr_scaling": "linear"})
    ) == pytest.approx(40 / 64)
    assert rampup_lr_factor(12, cfg) == 1.0


# -- the LambdaLR -----------------------------------------------------------------------------------------------
def _optimizer(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def test_scheduler_multiplies_schedule_rampup_and_extra_scale():
    cfg = TrainConfig(
        steps=50,
        warmup_steps=4,
        lr=0.1,
        lr_schedule="cosine",
        global_batch_size=64,
        micro_batch_size=4,
        rampup_start_batch=16,
        rampup_steps=12,
        rampup_lr_scaling="linear",
    )
    scale = {"value": 1.0}
    opt = _optimizer()
    sched = build_scheduler(opt, cfg, dp=2, extra_scale=lambda: scale["value"])
    seen = []
    for step in range(20):
        seen.append(opt.param_groups[0]["lr"])
        expected = 0.1 * lr_multiplier(step, cfg) * rampup_lr_factor(step, cfg, 2) * scale["value"]
        assert seen[-1] == pytest.approx(expected), f"step {step}"
        opt.step()
        if step == 10:
            scale["value"] = 0.5  # e.g. the spike guard halving the LR
            refresh_lr(sched)
            assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * seen[-1])
            assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]
        sched.step()
    assert sched.state_dict()["lr_lambdas"] == [None], (
        "a closure: the checkpoint holds no config or callable"
    )


def test_scheduler_keeps_the_old_call():
    cfg = TrainConfig(steps=20, warmup_steps=5, lr=0.2)
    opt = _optimizer(0.2)
    sched = build_scheduler(opt, cfg)
    for step in range(8):
        assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * lr_multiplier(step, cfg))
        opt.step()
        sched.step()


# -- validation ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(decay_fraction=0.0), "train.decay_fraction"),
        (dict(decay_fraction=1.5), "train.decay_fraction"),
        (dict(rampup_start_batch=64, rampup_steps=10), "train.rampup_start_batch"),
        (dict(rampup_start_batch=80, rampup_steps=10), "train.rampup_start_batch"),
        (
            dict(rampup_start_batch=6, rampup_steps=10),
            "train.rampup_start_batch",
        ),  # not a multiple of 4×2
        (dict(rampup_start_batch=-8), "train.rampup_start_batch"),
        (dict(rampup_start_batch=16, rampup_steps=0), "train.rampup_steps"),
        (dict(rampup_lr_scaling="cubic"), "train.rampup_lr_scaling"),
        (dict(lr_schedule="step"), "train.lr_schedule"),
    ],
)
def test_validate_schedule_names_the_field(changes, field):
    cfg = TrainConfig(global_batch_size=64, micro_batch_size=4, **changes)
    with pytest.raises(ConfigError) as err:
        validate_schedule(cfg, dp=2)
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_validate_schedule_accepts_valid_settings():
    validate_schedule(TrainConfig(), dp=1)
    validate_schedule(
        TrainConfig(
            global_batch_size=64,
            micro_batch_size=4,
            rampup_start_batch=8,
            rampup_steps=10,
            lr_schedule="wsd",
            decay_fraction=1.0,
            rampup_lr_scaling="none",
        ),
        dp=2,
    )


# -- range test logic -----------------------------------------------------------------------------------------------
def test_sweep_is_exponential_with_both_ends():
    lrs = sweep_lrs(1e-6, 1.0, 7)
    assert lrs[0] == pytest.approx(1e-6) and lrs[-1] == pytest.approx(1.0)
    assert [b / a for a, b in zip(lrs, lrs[1:])] == pytest.approx([10.0] * 6)


def test_range_test_smooths_with_bias_correction_and_stops_on_divergence():
    lrs = sweep_lrs(1e-4, 1.0, 50)

    def loss_at(lr):  # falls, bottoms out near lr 1e-2, then explodes
        return 5.0 - 2.0 * math.tanh(lr * 300) + (0.0 if lr < 0.02 else 1e4 * lr)

    result = range_test(loss_at, lrs)
    # bias correction: no pull towards 0
    assert result.smoothed[0] == pytest.approx(result.losses[0])
    average = 0.0
    for i, loss in enumerate(result.losses):
        average = 0.98 * average + 0.02 * loss
        assert result.smoothed[i] == pytest.approx(average / (1 - 0.98 ** (i + 1)))
    assert len(result.lrs) < 50 and "diverged" in result.stop_reason
    assert result.smoothed[-1] > 4 * min(result.smoothed[:-1])
    index = result.suggestion_index()
    assert index is not None and index < result.min_index
    assert 1e-3 < result.lrs[index] < 1e-2


@pytest.mark.fault("loss turns non-finite during lr-find", "the sweep stops there and says why")
def test_range_test_stops_on_nonfinite_loss():
    result = range_test(lambda lr: float("nan") if lr > 1e-3 else 3.0, sweep_lrs(1e-5, 1.0, 20))
    assert "non-finite" in result.stop_reason and not math.isfinite(result.losses[-1])
    assert all(math.isfinite(x) for x in result.losses[:-1])


def test_steepest_descent_looks_only_before_the_minimum():
    lrs = [10.0 ** (k / 2) for k in range(-8, 1)]
    smoothed = [
        5.0,
        4.9,
        4.0,
        3.9,
        3.85,
        3.8,
        2.0,
        6.0,
        9.0,
    ]  # the steepest *fall* is at index 5 → 6 (the minimum)
    assert steepest_descent_index(lrs, smoothed) == 5
    assert steepest_descent_index(lrs, [5.0, 5.0, 5.0, 6.0]) is None  # never falls
    assert steepest_descent_index(lrs, [1.0, 2.0, 3.0]) is None  # the minimum comes first


def test_csv_and_plot_are_written_whole(tmp_path):
    result = range_test(
        lambda lr: 6.0 - math.log10(lr / 1e-5) if lr < 1e-2 else 50.0, sweep_lrs(1e-5, 1.0, 30)
    )
    write_csv(tmp_path / "lr_find.csv", result)
    write_plot(tmp_path / "lr_find.png", result)
    with open(tmp_path / "lr_find.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [float(r["lr"]) for r in rows] == result.lrs  # repr round-trips exactly
    assert [float(r["smoothed_loss"]) for r in rows] == result.smoothed
    assert (tmp_path / "lr_find.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lr_find.csv", "lr_find.png"], (
        "no temp files left"
    )


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--steps", "1"], "--steps"),
        (["--min-lr", "1", "--max-lr", "0.1"], "--min-lr"),
        (["--beta", "1"], "--beta"),
    ],
)
def test_lr_find_rejects_bad_arguments_before_any_work(argv, field):
    args = build_parser().parse_args(["lr-find", *argv])
    with pytest.raises(ConfigError, match=field):
        cmd_lr_find(args)


def test_lr_find_without_matplotlib_says_what_to_install_before_any_work(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    args = build_parser().parse_args(["lr-find", "--out", str(tmp_path / "out")])
    with pytest.raises(ConfigError, match=r"pip install 'keel\[plot\]'") as info:
        cmd_lr_find(args)
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


# -- `keel lr-find` end to end ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_keel_lr_find_writes_csv_png_and_a_suggestion_in_the_falling_region(tmp_path, runs):
    out = tmp_path / "lr_find"
    cmd = [
        sys.executable,
        "-m",
        "keel.launcher.cli",
        "lr-find",
        "--steps",
        "40",
        "--min-lr",
        "1e-5",
        "--max-lr",
        "1",
        "--out",
        str(out),
        "--ds-config",
        str(REPO / "ds_configs/zero1.json"),
    ]
    for item in runs.overrides():  # the session's prepared tiny corpus
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    with open(out / "lr_find.csv") as handle:
        rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(handle)]
    assert 5 <= len(rows) <= 40
    lrs = [r["lr"] for r in rows]
    assert lrs == pytest.approx(sweep_lrs(1e-5, 1.0, 40)[: len(rows)], rel=1e-9), (
        "the engine used the sweep's LRs"
    )
    average = 0.0
    for i, row in enumerate(rows):
        average = 0.98 * average + 0.02 * row["loss"]
        assert row["smoothed_loss"] == pytest.approx(average / (1 - 0.98 ** (i + 1)), rel=1e-9)
    assert (out / "lr_find.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "lr_find.png").stat().st_size > 5000

    assert "steepest descent" in proc.stdout
    match = re.search(r"suggested lr: ([0-9.eE+-]+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    suggested = float(match.group(1))
    smoothed = [r["smoothed_loss"] for r in rows]
    lowest = min(
        range(len(rows)), key=lambda i: smoothed[i] if math.isfinite(smoothed[i]) else math.inf
    )
    assert smoothed[lowest] < smoothed[0] - 0.1, "the tiny model must learn during the sweep"
    assert 1e-5 <= suggested < lrs[lowest] * (1 + 1e-5), "suggestion must lie before the minimum"
    index = min(range(len(rows)), key=lambda i: abs(math.log(lrs[i] / suggested)))
    assert smoothed[index + 1] < smoothed[index], "the smoothed loss is falling at the suggestion"
