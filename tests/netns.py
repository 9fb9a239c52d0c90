"""Two "nodes" on one machine: Linux network namespaces joined by a veth pair (needs root and `ip`).

Each namespace has its own loopback and one veth end; the pair's addresses (10.231.0.1/24 and 10.231.0.2/24 by
default) exist only inside the two namespaces, so nothing here touches the host's own network. Teardown kills
every process still inside either namespace and deletes both (which deletes the veth pair too).

    with TwoNodes() as nodes:            # raises NetnsUnavailable when namespaces cannot be created
        a = nodes.popen("a", ["python", "-c", "..."], env=..., stdout=log_file)
        nodes.kill_all("b")              # SIGKILL every process inside namespace b
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass


class NetnsUnavailable(RuntimeError):
    """Network namespaces or the veth pair cannot be created here; the message is the exact error."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
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
    def __enter__(self) -> "TwoNodes":
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
            for _ in range(20):  # a process that is still exiting keeps the namespace busy for a moment
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
        proc = subprocess.Popen(["ip", "netns", "exec", self.nodes[name].netns, *cmd], start_new_session=True,
                                **kwargs)
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
