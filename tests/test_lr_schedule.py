from __future__ import annotations

import math

import pytest

from keel.config import TrainConfig
from keel.engine.lr_schedule import lr_multiplier


def test_warmup_then_cosine_to_min_ratio():
    cfg = TrainConfig(steps=110, warmup_steps=10, min_lr_ratio=0.1, lr_schedule="cosine")
    assert lr_multiplier(0, cfg) == pytest.approx(0.1)
    assert lr_multiplier(9, cfg) == pytest.approx(1.0)
    assert lr_multiplier(10, cfg) == pytest.approx(1.0)
    assert lr_multiplier(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(110, cfg) == pytest.approx(0.1)
    assert lr_multiplier(500, cfg) == pytest.approx(0.1)


def test_linear_and_constant():
    linear = TrainConfig(steps=20, warmup_steps=0, min_lr_ratio=0.0, lr_schedule="linear")
    assert [lr_multiplier(s, linear) for s in (0, 10, 20)] == pytest.approx([1.0, 0.5, 0.0])
    constant = TrainConfig(steps=20, warmup_steps=4, lr_schedule="constant")
    assert lr_multiplier(2, constant) == pytest.approx(0.75) and lr_multiplier(15, constant) == 1.0
