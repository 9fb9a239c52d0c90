"""Fuzzed configs: YAML fields, `--set` values and DeepSpeed JSON keys, drawn from the schema and its bounds.

Every invalid case goes through `keel train` in this process: exit 2 with exactly one stderr line naming the
field, never a traceback, nothing written, no rank started. Valid cases go through `build_run` (the check the
CLI runs before any rank starts) and must read every field back as given, also from the run dir it writes.
Derandomized, so CI draws the same ~2000 cases each run.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import shutil
import sys
import typing
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keel.config import ConfigError, RunConfig
from keel.config.bounds import BOUNDS
from keel.engine.ds_config import check_with_deepspeed, load_ds_config, resolve_ds_config
from keel.launcher.cli import _external_world_size, build_parser, main
from keel.launcher.run_spec import build_run, write_run_dir
from keel.run_dir import read_run_dir
from tests.faults.bad_cases import invalid_cases
from tests.faults.config_cases import HINTS, Case, valid_cases
from tests.keel_runs import REPO

VALID_CASES, INVALID_CASES, WORLD_SIZE_CASES = 400, 1500, 100
PER_EXAMPLE = 3  # invalid cases per hypothesis example: its per-example bookkeeping costs as much as a small case
# how a user's YAML file looks (PyYAML's own writer)
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
PARSER = build_parser()  # built once: argparse's construction would be a third of each case


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


class Accepted(Exception):
    """`keel train` went past its checks (to data preparation) with an invalid case."""


class Workspace:
    """Writes a case's files (one YAML, one DeepSpeed JSON, a fresh run dir path per case) under `root`."""

    def __init__(self, root: Path):
        self.root, self.counter = root, itertools.count()

    def files(self, case: Case) -> tuple[str, str | None, Path]:
        """(config path, --ds-config value or None, run dir)."""
        ds_path = case.ds_path or str(self.root / "ds.json")
        if not case.ds_path:
            text = case.ds if isinstance(case.ds, str) else json.dumps(case.ds, allow_nan=True)
            Path(ds_path).write_text(text)
        by_field = (
            case.ds_by_field
            and isinstance(case.config, dict)
            and not case.ds_path
            and isinstance(case.config.get("train", {}), dict)
        )
        if by_field:
            config = {
                **case.config,
                "train": {**case.config.get("train", {}), "ds_config": ds_path},
            }
        else:
            config = case.config
        config_path = self.root / "run.yaml"
        config_path.write_text(
            config if isinstance(config, str) else yaml.dump(config, Dumper=DUMPER)
        )
        run_dir = self.root / f"run{next(self.counter)}"
        if case.saved_config is not None:
            run_dir.mkdir()
            (run_dir / "config.yaml").write_text(case.saved_config)
        return str(config_path), None if by_field else ds_path, run_dir


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("fuzz"))


def accepted(*args: object) -> None:
    raise Accepted


def run_cli(argv: list[str]) -> tuple[int, str]:
    """`keel <argv>` in this process: (exit code, stderr); stops at data preparation with `Accepted`, and
    `os._exit` (a rank's way out) raises SystemExit instead of ending pytest."""
    err = io.StringIO()
    with (
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
        mock.patch("keel.launcher.run_spec.prepare_data", new=accepted),
        mock.patch("keel.launcher.cli.build_parser", new=lambda: PARSER),
        mock.patch.object(os, "_exit", new=sys.exit),
    ):
        try:
            main(argv)
            code = 0
        except SystemExit as exit_info:
            code = exit_info.code
    return code, err.getvalue()


def check_valid(case: Case, workspace: Workspace) -> None:
    config, ds_config, run_dir = workspace.files(case)
    spec = build_run(config, case.sets, ds_config, str(run_dir), case.world)
    for name, value in case.values.items():
        section, key = name.split(".")
        assert getattr(getattr(spec.cfg, section), key) == value, (name, value)
    write_run_dir(spec)
    cfg, ds_raw, _ = read_run_dir(run_dir)
    assert cfg == spec.cfg and ds_raw == spec.ds_raw
    shutil.rmtree(run_dir)


def check_invalid(case: Case, workspace: Workspace) -> None:
    config, ds_config, run_dir = workspace.files(case)
    argv = ["train", config, "--nproc", str(case.world), "--run-dir", str(run_dir)]
    argv += ["--ds-config", ds_config] if ds_config else []
    for item in case.sets:
        argv += ["--set", item]
    code, err = run_cli(argv)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("keel: error: "), (code, err)
    assert any(name in lines[0] for name in case.names), (case.names, lines[0])
    written = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    assert written == ([] if case.saved_config is None else ["config.yaml"])


@fuzz(VALID_CASES)
@given(case=valid_cases())
def test_valid_configs_pass_and_read_back_unchanged(case: Case, workspace: Workspace) -> None:
    check_valid(case, workspace)


@pytest.mark.fault(
    "fuzzed invalid config/--set/DeepSpeed JSON",
    "one line naming the field, exit 2, before any rank",
)
@fuzz(INVALID_CASES // PER_EXAMPLE)
@given(cases=st.lists(invalid_cases(), min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
def test_invalid_configs_give_one_line_naming_the_field(
    cases: list[Case], workspace: Workspace
) -> None:
    for case in cases:
        check_invalid(case, workspace)


WORLD_SIZES = st.one_of(
    st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=6),
    st.integers(-5, 10**20).map(str),
    st.sampled_from(["2.5", "1e3", " 2 ", "0", "-1", "", "\u0663", "1_0", "+2", "0x10", "nan"]),
)


@pytest.mark.fault(
    "fuzzed WORLD_SIZE from an external launcher", "one line naming WORLD_SIZE, exit 2"
)
@fuzz(WORLD_SIZE_CASES)
@given(value=WORLD_SIZES)
def test_world_size_from_the_environment(value: str, workspace: Workspace) -> None:
    """An external launcher's WORLD_SIZE: a positive decimal integer, else one line naming it."""
    with mock.patch.dict(os.environ, {"RANK": "0", "WORLD_SIZE": value}):
        if re.fullmatch(r"\s*[0-9]+\s*", value) and int(value) >= 1:
            assert _external_world_size() == int(value)
            return
        code, err = run_cli(["train", "--run-dir", str(workspace.root / "never")])
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("keel: error: WORLD_SIZE"), (
        code,
        err,
    )


def test_every_numeric_field_has_a_bound() -> None:
    """The fuzzer and the validator both read keel/config/bounds.py: a new number needs its range there."""

    def numeric(hint: typing.Any) -> bool:
        args = typing.get_args(hint)
        return hint in (int, float) or bool(args) and all(a in (int, float) for a in args)

    assert {name for name, hint in HINTS.items() if numeric(hint)} == set(BOUNDS)


@pytest.mark.parametrize("path", sorted((REPO / "ds_configs").glob("*.json")), ids=lambda p: p.name)
def test_shipped_ds_configs_pass_deepspeeds_prelaunch_check(path: Path) -> None:
    """Every key of a shipped DeepSpeed JSON is one DeepSpeed reads (so the near-miss check has no false alarm)."""
    check_with_deepspeed(resolve_ds_config(load_ds_config(path), RunConfig(), dp_size=2))
    with pytest.raises(
        ConfigError, match=r"^ds_config\.zero_optimisation: .* did you mean zero_optimization\?$"
    ):
        check_with_deepspeed(
            resolve_ds_config(
                {**load_ds_config(path), "zero_optimisation": {"stage": 3}}, RunConfig(), dp_size=2
            )
        )
