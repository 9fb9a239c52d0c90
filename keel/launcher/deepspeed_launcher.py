"""`keel train --launcher deepspeed`: start the ranks through DeepSpeed's own `deepspeed` launcher.

The launcher starts `python -m keel.launcher.cli train ...` on every slot of the hostfile with RANK,
WORLD_SIZE, LOCAL_RANK and MASTER_* set, so each rank runs Keel "in place". With `--no-ssh` the command is run
once per node with its `--node-rank` (DeepSpeed's `--no_ssh` mode); without it DeepSpeed reaches the other
nodes itself (pdsh/ssh by default).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from keel.config import ConfigError


def hostfile_slots(path: str | Path) -> list[tuple[str, int]]:
    """`host slots=N` lines (DeepSpeed's hostfile format); comments and blank lines ignored."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--hostfile: {path} does not exist")
    hosts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
            raise ConfigError(
                f"--hostfile: {path}:{number}: expected 'hostname slots=N', got {line!r}"
            )
        hosts.append((parts[0], int(parts[1][6:])))
    if not hosts:
        raise ConfigError(f"--hostfile: {path} lists no hosts")
    return hosts


def hostfile_without_bad_nodes(hostfile: str | Path, run_dir: Path) -> tuple[Path, list[str]]:
    """The hostfile less the nodes the run dir records as bad (keel/run_dir/bad_nodes.py), written beside the
    run's other files, and the hosts left out; the hostfile itself when none of its hosts is recorded."""
    from keel.run_dir.bad_nodes import bad_hosts

    slots = hostfile_slots(hostfile)
    bad = set(bad_hosts(run_dir))
    left_out = [host for host, _ in slots if host in bad]
    if not left_out:
        return Path(hostfile), []
    kept = [(host, n) for host, n in slots if host not in bad]
    path = run_dir / "hostfile.without_bad_nodes"
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{host} slots={n}\n" for host, n in kept))
    return path, left_out


def deepspeed_command(
    keel_args: list[str],
    hostfile: str,
    no_ssh: bool,
    node_rank: int,
    master_addr: str | None,
    master_port: int,
    command: str = "train",
) -> list[str]:
    """The `deepspeed` command line that starts `keel COMMAND KEEL_ARGS...` (train or preflight) on every slot."""
    launcher = shutil.which("deepspeed") or ""
    cmd = [launcher] if launcher else [sys.executable, "-m", "deepspeed.launcher.runner"]
    cmd += [
        "--hostfile",
        str(hostfile),
        "--master_port",
        str(master_port),
        "--no_local_rank",
        "--module",
    ]
    if master_addr:
        cmd += ["--master_addr", master_addr]
    if no_ssh:
        cmd += ["--no_ssh", "--node_rank", str(node_rank)]
    return [*cmd, "keel.launcher.cli", command, *keel_args]


def launch_deepspeed(
    keel_args: list[str],
    hostfile: str,
    no_ssh: bool,
    node_rank: int,
    master_addr: str | None,
    master_port: int,
    command: str = "train",
) -> int:
    cmd = deepspeed_command(
        keel_args, hostfile, no_ssh, node_rank, master_addr, master_port, command
    )
    print("keel: " + " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode
