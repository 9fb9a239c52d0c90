"""logging.sync_debug: torch's synchronizing-call warnings counted by site (the counting; CUDA makes them)."""

from __future__ import annotations

import json
import warnings

import pytest

from keel.config import ConfigError, build_config, validate
from keel.training.observe.sync_debug import SyncCounter


def test_counts_sync_warnings_by_site_and_passes_others_on(tmp_path):
    counter = SyncCounter("warn", "cpu", tmp_path, rank=1)
    # CPU makes no such warnings: feed the counter what torch would issue on CUDA
    counter.enabled = True
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("always")
        for _ in range(3):
            with warnings.catch_warnings(record=True) as step:
                warnings.simplefilter("always")
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
                warnings.warn("something else", UserWarning, stacklevel=1)
            counter.steps += 1
            counter.count(step)
    assert [str(w.message) for w in outer] == ["something else"] * 3
    counter.report()
    written = json.loads((tmp_path / "sync_debug_rank1.json").read_text())
    assert written["syncs"] == 3 and list(written["sites"].values()) == [3]
    assert next(iter(written["sites"])).startswith(__file__)


def test_off_the_gpu_it_does_nothing(tmp_path):
    counter = SyncCounter("warn", "cpu", tmp_path, rank=0)
    for _ in range(2):
        with counter.step():
            pass
    counter.report()
    assert not counter.enabled and not (tmp_path / "sync_debug_rank0.json").exists()


def test_bad_mode_is_one_line():
    cfg = build_config({"logging": {"sync_debug": "loud"}})
    with pytest.raises(ConfigError, match="logging.sync_debug"):
        validate(cfg, 1)
