"""Shared fixtures: a small real corpus prepared once per session, and a runner for real `keel train` jobs."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from tests.keel_runs import RunCache


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the long multi-process tests (CI does)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="multi-process test: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def small_corpus() -> list[str]:
    """A few real stdlib packages: enough text for a 512-token vocabulary, quick to tokenize."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(stdlib / "json" / "*.py"), str(stdlib / "email" / "*.py"), str(stdlib / "http" / "*.py")]


@pytest.fixture(scope="session")
def runs(tmp_path_factory, small_corpus) -> RunCache:
    return RunCache(tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("data_cache"), small_corpus)
