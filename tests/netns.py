"""Two "nodes" on one machine: Linux network namespaces joined by a veth pair (needs root and `ip`).

Each namespace has its own loopback and one veth end; the pair's addresses (10.231.0.1/24 and 10.231.0.2/24 by
default) exist only inside the two namespaces, so nothing here touches the host's own network. Teardown kills
every process still inside either namespace and deletes both (which deletes the veth pair too).

    with TwoNodes() as nodes:            # raises NetnsUnavailable when namespaces cannot be created
        a = nodes.popen("a", ["python", "-c", "..."], env=..., stdout=log_file)
        nodes.kill_all("b")              # SIGKILL every process inside namespace b

`torchrun_cmd` and `node_env` build one node's torchrun command line (one rank per node, c10d rendezvous hosted
by node A's agent) and environment; tests/test_elastic_netns.py and bench/recovery.py share them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

RDZV_PORT = 29400  # inside node A's namespace: a fresh network stack, so the port is free
# join: how long a node waits for a rendezvous round; last_call: how long a round with at least min nodes stays
# open for latecomers; keep_alive: a dead node's agent is dropped after interval × max_attempt seconds
RDZV_CONF = "join_timeout=120,last_call_timeout=3,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


class NetnsUnavailable(RuntimeError):
    """Network namespaces or the veth pair cannot be created here; the message is the exact error."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetnsUnavailable(
            f"`ip {' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}"
        )
    return proc


@dataclass
class Node:
    name: str  # "a" or "b"
    netns: str  # the namespace's name
    ifname: str  # the veth end inside it
    addr: str  # its address on the veth pair


class TwoNodes:
    def __init__(self, subnet: str = "10.231.0", prefix: str = "keel"):
        tag = uuid.uuid4().hex[:6]
        # interface names are at most 15 characters
        self.nodes = {
            "a": Node("a", f"{prefix}-a-{tag}", f"kv{tag}a", f"{subnet}.1"),
            "b": Node("b", f"{prefix}-b-{tag}", f"kv{tag}b", f"{subnet}.2"),
        }
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    # -- setup / teardown ---------------------------------------------------------------------------------------
    def __enter__(self) -> TwoNodes:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("`ip` (iproute2) is not installed")
        try:
            a, b = self.nodes["a"], self.nodes["b"]
            for node in (a, b):
                _ip("netns", "add", node.netns)
                self._created.append(node.netns)
            _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
            for node in (a, b):
                _ip("link", "set", node.ifname, "netns", node.netns)
                _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
                _ip("-n", node.netns, "link", "set", "lo", "up")
                _ip("-n", node.netns, "link", "set", node.ifname, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in both namespaces (and those we started), then delete the namespaces."""
        for proc in self._procs:
            _kill_group(proc)
        for netns in self._created:
            self._kill_pids(netns)
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for netns in self._created:
            # a process that is still exiting keeps the namespace busy for a moment
            for _ in range(20):
                if _ip("netns", "del", netns, check=False).returncode == 0:
                    break
                self._kill_pids(netns)
                time.sleep(0.25)
        # the veth pair dies with its namespaces; remove it here too in case it never got moved into them
        _ip("link", "del", self.nodes["a"].ifname, check=False)
        self._created.clear()

    # -- processes ----------------------------------------------------------------------------------------------
    def popen(self, name: str, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start `cmd` inside node `name`'s namespace, in a new session (its own process group)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.nodes[name].netns, *cmd], start_new_session=True, **kwargs
        )
        self._procs.append(proc)
        return proc

    def pids(self, name: str) -> list[int]:
        return self._pids(self.nodes[name].netns)

    def kill_all(self, name: str) -> list[int]:
        """SIGKILL every process inside node `name`'s namespace (the whole "node" dies at once)."""
        return self._kill_pids(self.nodes[name].netns)

    @staticmethod
    def _pids(netns: str) -> list[int]:
        out = _ip("netns", "pids", netns, check=False).stdout
        return sorted(int(pid) for pid in out.split())

    def _kill_pids(self, netns: str) -> list[int]:
        killed = []
        for _ in range(5):  # a forking process may add a pid between listing and killing
            pids = [pid for pid in self._pids(netns) if pid != os.getpid()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        return killed


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def torchrun_cmd(
    node: Node,
    endpoint: str,
    run_id: str,
    is_host: bool,
    program: list[str],
    max_restarts: int = 3,
    nnodes: str = "1:2",
) -> list[str]:
    """torchrun for one node of an elastic 1..2-node job, one rank per node. `is_host`: this node's agent hosts
    the c10d rendezvous store (the endpoint is its address, which torch cannot recognise from the hostname
    because both namespaces share one). `--local_addr` makes the node advertise its veth address, which then
    becomes MASTER_ADDR when it is node rank 0. `nnodes` "2": a lost node must come back (or be replaced) before
    the job goes on."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint}",
        f"--rdzv_id={run_id}",
        f"--rdzv_conf={RDZV_CONF},is_host={int(is_host)}",
        f"--local_addr={node.addr}",
        f"--max_restarts={max_restarts}",
        "--monitor_interval=1",
        *program,
    ]


def node_env(node: Node, repo) -> dict[str, str]:
    """The environment for one node: gloo bound to the node's veth, restarts that work with torch 2.13."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    env.update(
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME=node.ifname,
        # both namespaces share one host name: name the nodes as SLURM would (keel.run_dir.node_name)
        SLURMD_NODENAME=f"node-{node.name}",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=path,
    )
    return env


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""
