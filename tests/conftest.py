"""Shared fixtures: a small real corpus prepared once per session, and a runner for real `keel train` jobs.

The suite runs on pytest-xdist workers (one more than the cores, `-n auto` in pyproject.toml): the multi-process
tests spend a third of their time waiting (rendezvous, sleeps, process exits, another worker's launch), which the
other workers' tests fill. A test module is the unit a worker takes whole (its module fixtures start once), the
modules sharing the SLURM cluster go to one worker together (`pytest_xdist_make_scheduler`), and the shared
launches of `keel train` runs are shared between workers (tests/keel_runs.py).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

from tests.keel_runs import Run, RunCache

DECLARED_RUNS = pytest.StashKey[list[Run]]()
RUN_CACHE = pytest.StashKey[RunCache]()
FAULT_ROWS = pytest.StashKey[list[tuple[str, str, str]]]()
LAUNCHES = pytest.StashKey[tuple[list, list[str]]]()  # what the xdist workers' shared launches were


def pytest_addoption(parser):
    parser.addoption(
        "--slow", action="store_true", help="also run the long multi-process tests (CI does)"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.user_properties += [("fault", list(mark.args)) for mark in item.iter_markers("fault")]
    _heaviest_modules_first(items)
    if not config.getoption("--slow"):
        skip = pytest.mark.skip(reason="multi-process test: run with --slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    if not _cuda_available():
        skip_gpu = pytest.mark.skip(
            reason="needs CUDA: torch sees no GPU here (bench/device_check.sh runs these)"
        )
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    # the runs the selected tests' modules declare train in shared launches (tests/keel_runs.py)
    modules = {item.module for item in items if item.get_closest_marker("skip") is None}
    config.stash[DECLARED_RUNS] = [
        run for module in modules for run in getattr(module, "KEEL_RUNS", [])
    ]


def pytest_collection_finish(session):
    # after -k/-m deselection (which runs in other plugins' modifyitems hooks): the rows of the tests this session runs
    session.config.stash[FAULT_ROWS] = fault_rows(session.items)


def _heaviest_modules_first(items) -> None:
    """Modules go out to the workers in collection order (`--no-loadscope-reorder`): the SLURM group first, then
    by their count of multi-process `slow` tests, so no worker is left with a long module when the other is done."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(_module(item.nodeid), []).append(item)
    weight = {
        path: (
            not any("slurm_cluster" in i.fixturenames for i in members),
            -sum("slow" in i.keywords for i in members),
        )
        for path, members in modules.items()
    }
    items.sort(key=lambda item: weight[_module(item.nodeid)])


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker more than the cores this process may use. With one per core the cores idle whenever
    every worker waits (on a SLURM job, a watchdog's deadline, a launch another worker trains); the spare
    worker's tests fill that time (bench/results/ci_run_cpu_20261205.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) + 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """A worker takes a test module whole (its module fixtures start once); the modules that use the SLURM cluster
    fixture are one unit (one cluster per host). The controller sees node ids only, so those modules are found by
    reading the test sources for the fixture's name."""
    from xdist.scheduler import LoadScopeScheduling

    slurm = {
        str(path.relative_to(config.rootpath))
        for path in (config.rootpath / "tests").rglob("test_*.py")
        if "slurm_cluster" in path.read_text()
    }

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return "slurm" if module in slurm else module

    return ModuleScheduling(config, log)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def fault_rows(items) -> list[tuple[str, str, str]]:
    """(test node id, fault, what Keel does) for every collected test marked `@pytest.mark.fault(fault, action)`."""
    rows = []
    for item in items:
        for mark in item.iter_markers("fault"):
            if len(mark.args) != 2 or not all(isinstance(a, str) and a for a in mark.args):
                raise pytest.UsageError(
                    f"{item.nodeid}: @pytest.mark.fault takes (fault, action), two strings"
                )
            rows.append((item.nodeid, *mark.args))
    return rows


def pytest_sessionfinish(session):
    # an xdist worker hands its launches to the controller, which prints them (pytest_testnodedown)
    cache = session.config.stash.get(RUN_CACHE, None)
    if cache is not None and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["keel_launches"] = cache.launches
        session.config.workeroutput["keel_undeclared"] = cache.undeclared


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    output = getattr(node, "workeroutput", {})
    launches, undeclared = node.config.stash.setdefault(LAUNCHES, ([], []))
    launches += [tuple(launch) for launch in output.get("keel_launches", [])]
    undeclared += output.get("keel_undeclared", [])


def pytest_terminal_summary(terminalreporter, config):
    _kernel_tests_summary(terminalreporter)
    _fault_matrix(terminalreporter)
    launches, undeclared = config.stash.get(LAUNCHES, ([], []))
    cache = config.stash.get(RUN_CACHE, None)
    if cache is not None:  # run without workers
        launches, undeclared = cache.launches, cache.undeclared
    if not launches:
        return
    terminalreporter.write_line(
        f"keel runs: {sum(len(n) for _, n, _ in launches)} runs in {len(launches)} shared launches"
    )
    for world, names, seconds in launches:
        terminalreporter.write_line(
            f"  {world} rank(s), {len(names)} run(s), {seconds:.1f} s: {', '.join(names)}"
        )
    if undeclared:
        terminalreporter.write_line(
            f"keel runs not declared in KEEL_RUNS (each got a launch of its own): {undeclared}"
        )


def _fault_matrix(terminalreporter) -> None:
    """The fault matrix of this session: each fault-marked test's outcome, the fault, what Keel does (read off the
    test reports, which carry the marks as user properties: workers send reports, not items)."""
    outcome_of: dict[str, str] = {}
    marks: dict[str, list[tuple[str, str]]] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            faults = [tuple(v) for k, v in getattr(report, "user_properties", []) if k == "fault"]
            if not faults:
                continue
            marks[nodeid] = faults
            if outcome_of.get(nodeid) not in (
                "failed",
                "error",
            ):  # a failed call outranks a passed setup
                outcome_of[nodeid] = outcome
    rows = [(nodeid, *fault) for nodeid in sorted(marks) for fault in marks[nodeid]]
    if not rows:
        return
    terminalreporter.write_sep("-", f"fault matrix ({len(rows)} rows)")
    for nodeid, fault, action in rows:
        terminalreporter.write_line(
            f"{outcome_of.get(nodeid, 'not run'):8} {fault} -> {action}  [{nodeid}]"
        )


def _kernel_tests_summary(terminalreporter) -> None:
    """How many Liger kernel tests (tests/test_kernels.py) ran here and why the others skipped (the issue asks)."""
    outcomes: dict[str, int] = {}
    reasons: set[str] = set()
    for outcome in ("passed", "failed", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            if "test_kernels.py" in getattr(report, "nodeid", "") and report.when in (
                "call",
                "setup",
            ):
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                if outcome == "skipped" and isinstance(report.longrepr, tuple):
                    reasons.add(report.longrepr[2].removeprefix("Skipped: "))
    if outcomes:
        terminalreporter.write_line(
            "kernel tests: "
            + ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items()))
            + (f" ({'; '.join(sorted(reasons))})" if reasons else "")
        )


@pytest.fixture(scope="session")
def small_corpus() -> list[str]:
    """A few real stdlib packages: enough text for a 512-token vocabulary, quick to tokenize."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [
        str(stdlib / "json" / "*.py"),
        str(stdlib / "email" / "*.py"),
        str(stdlib / "http" / "*.py"),
    ]


@pytest.fixture(scope="session")
def runs(request, tmp_path_factory, small_corpus) -> RunCache:
    # an xdist worker's base temp dir is the session's, plus the worker's name: its parent is shared
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
    cache = RunCache(shared / "runs", shared / "data_cache", small_corpus)
    cache.declare(request.config.stash.get(DECLARED_RUNS, []))
    request.config.stash[RUN_CACHE] = cache
    return cache


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """One real SLURM cluster (Debian's slurm 22.05, 2 nodes on this host) for every module that submits jobs."""
    from tests.slurm_cluster import SlurmCluster, ensure_installed

    reason = ensure_installed()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    print(f"\nslurm cluster up in {cluster.start_seconds:.1f} s")
    yield cluster
    cluster.stop()
