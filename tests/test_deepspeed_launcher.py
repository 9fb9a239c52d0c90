"""`keel train --launcher deepspeed`: DeepSpeed's launcher starts the ranks (localhost, --no_ssh)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from keel.config import ConfigError
from keel.launcher.deepspeed_launcher import deepspeed_command, hostfile_slots
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
