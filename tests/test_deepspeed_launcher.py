"""`keel train --launcher deepspeed`: DeepSpeed's launcher starts the ranks (localhost, --no_ssh)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from keel.config import ConfigError
from keel.launcher.cli import main
from keel.launcher.deepspeed_launcher import (
    deepspeed_command,
    hostfile_slots,
    hostfile_without_bad_nodes,
)
from keel.run_dir import ExitCode
from keel.run_dir.bad_nodes import record_bad_node
from keel.training.observe.metrics import read_metrics
from tests.keel_runs import REPO, Run
from tests.test_train_equivalence import assert_close

KEEL_RUNS = [Run.of("zero0", 2)]


def test_hostfile_parsing_and_command(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode1 slots=8\nnode2 slots=8\n")
    assert hostfile_slots(hostfile) == [("node1", 8), ("node2", 8)]
    cmd = deepspeed_command(["--run-dir", "r"], str(hostfile), True, 1, "node1", 29501)
    assert cmd[-4:] == ["keel.launcher.cli", "train", "--run-dir", "r"]
    assert {"--no_ssh", "--no_local_rank", "--module"} <= set(cmd)
    assert (
        cmd[cmd.index("--node_rank") + 1] == "1" and cmd[cmd.index("--master_addr") + 1] == "node1"
    )
    hostfile.write_text("node1 8\n")
    with pytest.raises(ConfigError, match="expected 'hostname slots=N'"):
        hostfile_slots(hostfile)


@pytest.mark.slow
def test_deepspeed_launcher_no_ssh_on_localhost(runs, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "keel.launcher.cli",
        "train",
        "--launcher",
        "deepspeed",
        "--hostfile",
        str(hostfile),
        "--no-ssh",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "29517",
        "--run-dir",
        str(run_dir),
        "--ds-config",
        str(REPO / "ds_configs" / "zero0.json"),
    ]
    for item in runs.overrides():
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--no_ssh" in proc.stdout and "world=2" in proc.stdout
    reference = [r["loss"] for r in read_metrics(runs.get("zero0", 2) / "metrics.jsonl")]
    assert_close([r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")], reference, 1e-5)


def test_hosts_recorded_bad_are_left_out_of_the_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 slots=2\nnode3 slots=2\n")
    run_dir = tmp_path / "run"
    assert hostfile_without_bad_nodes(hostfile, run_dir) == (hostfile, [])
    record_bad_node(run_dir, "node2", "hang", 7, rank=3)
    kept, left_out = hostfile_without_bad_nodes(hostfile, run_dir)
    assert left_out == ["node2"] and kept.parent == run_dir
    assert hostfile_slots(kept) == [("node1", 2), ("node3", 2)]


@pytest.mark.fault(
    "deepspeed launcher: the hostfile's good hosts are too few for the layout",
    "bad hosts left out; one line, exit 9, before any rank starts",
)
@pytest.mark.parametrize("no_ssh", [False, True])
def test_too_few_hosts_without_the_bad_ones_is_one_line_and_exit_9(tmp_path, capsys, no_ssh):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    run_dir = tmp_path / "run"
    record_bad_node(run_dir, "node2", "checksum", 40, ranks=[1])
    cmd = [
        "train",
        "--launcher",
        "deepspeed",
        "--hostfile",
        str(hostfile),
        "--run-dir",
        str(run_dir),
    ]
    cmd += ["--set", "parallel.tp=2", "--set", "model.n_kv_heads=2"]  # needs both ranks
    if no_ssh:
        cmd += ["--no-ssh", "--node-rank", "0"]
    with pytest.raises(SystemExit) as exited:
        main(cmd)
    assert exited.value.code == ExitCode.PREFLIGHT
    err = capsys.readouterr().err
    if no_ssh:
        assert "node(s) node2 are recorded in bad_nodes.json: with --no-ssh, remove them" in err
    else:
        assert "too few nodes remain without node2 (bad_nodes.json): " in err
        assert "parallel" in err.splitlines()[-1]
