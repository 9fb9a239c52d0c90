"""A real, throwaway SLURM cluster for the tests: Debian's munged + slurmctld + two slurmd on 127.0.0.1.

Two virtual nodes (`slurmd -N node1`, `slurmd -N node2`, each on its own port) share this machine. Everything
(config, munge key and socket, state, spool, logs) lives under one temporary directory, the daemons run in
the foreground as children of the test process, and `stop()` ends each one by its pid, after cancelling the
jobs and ending, by pid, any job process still left (those whose environment names this cluster's slurm.conf).

Facts this relies on (Debian 12, SLURM 22.05):
- `SlurmdParameters=config_overrides` lets a node advertise more CPUs than the host has;
- munged refuses a socket directory that others cannot read: it must be 0755;
- slurmd needs its spool directory's parent to exist;
- the virtual node names do not resolve (NodeAddr=127.0.0.1 is how SLURM reaches them);
- a requeued job may start again only after the job credential expires (120 s by default):
  `AuthInfo=...,cred_expire=10` makes that 10 s.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = [
    "munged",
    "mungekey",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "sinfo",
    "squeue",
    "scancel",
]


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def ensure_installed(timeout: int = 600) -> str | None:
    """Install Debian's SLURM and munge packages if missing; None when ready, else why they cannot be had."""
    if not missing_binaries():
        return None
    if shutil.which("apt-get") is None:
        return f"SLURM is not installed ({', '.join(missing_binaries())} missing) and there is no apt-get"
    if os.geteuid() != 0:
        return f"SLURM is not installed ({', '.join(missing_binaries())} missing) and installing needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:  # maybe the package lists are missing or stale
        subprocess.run(
            ["apt-get", "update", "-q"], capture_output=True, text=True, env=env, timeout=timeout
        )
        proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0 or missing_binaries():
        return f"apt-get could not install {' '.join(PACKAGES)}: {(proc.stderr or proc.stdout).strip()[-500:]}"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_ports(n: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """`SlurmCluster(tmp).start()`; commands run with `cluster.env` (SLURM_CONF points at this cluster)."""

    def __init__(self, root: Path, nodes: int = 2, cpus_per_node: int = 4, cred_expire: int = 10):
        self.root = Path(root)
        self.nodes = [f"node{i + 1}" for i in range(nodes)]
        self.cpus_per_node = cpus_per_node
        self.cred_expire = cred_expire
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[tuple[str, subprocess.Popen]] = []
        self.start_seconds: float | None = None

    # -- setup --------------------------------------------------------------------------------------------------
    def _write_config(self) -> None:
        r = self.root
        for d in ("etc", "state", "spool", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        nodes = "\n".join(
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus_per_node} "
            "State=UNKNOWN"
            for name, port in zip(self.nodes, node_ports)
        )
        self.conf.write_text(f"""\
ClusterName=keeltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=10
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.root / "log" / f"{name}.out", "w")
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.root,
        )
        log.close()
        self._daemons.append((name, proc))
        return proc

    def _start_munge(self) -> None:
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(munge_dir, 0o755)  # munged refuses a socket directory that others cannot reach
        key = munge_dir / "munge.key"
        subprocess.run(
            [_binary("mungekey"), "--create", "--force", f"--keyfile={key}"],
            check=True,
            capture_output=True,
        )
        os.chmod(key, 0o600)
        self._spawn(
            "munged",
            [
                _binary("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge_dir}/munged.pid",
                f"--log-file={self.root}/log/munged.log",
                f"--seed-file={munge_dir}/munged.seed",
            ],
        )
        self._wait(lambda: self.munge_socket.exists(), 10, "munged did not create its socket")

    def start(self, timeout: float = 60) -> SlurmCluster:
        t0 = time.monotonic()
        try:
            self._write_config()
            self._start_munge()
            self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)])
            for name in self.nodes:
                (self.root / "spool" / name).mkdir(parents=True, exist_ok=True)
                self._spawn(
                    f"slurmd.{name}", [_binary("slurmd"), "-D", "-N", name, "-f", str(self.conf)]
                )
            self._wait(self._nodes_idle, timeout, "the nodes did not become idle")
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _nodes_idle(self) -> bool:
        out = self.run(
            ["sinfo", "--noheader", "--Node", "--format=%N %t"], check=False
        ).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self._daemons:
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited with {proc.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"{what} within {timeout:.0f} s:\n{self.logs()}")
            time.sleep(0.3)

    # -- use ----------------------------------------------------------------------------------------------------
    def run(
        self, cmd: list[str], check: bool = True, timeout: float = 60, **kwargs
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=self.env, timeout=timeout, **kwargs
        )
        if check and proc.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def job(self, job_id: int | str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, Reason, ...)."""
        out = self.run(["scontrol", "show", "job", "--oneliner", str(job_id)]).stdout
        fields = {}
        for item in out.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: int | str, timeout: float, until=None) -> dict[str, str]:
        """Poll until `until(job)` (default: the job has ended); returns the last `scontrol show job`."""
        ended = {
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
            "BOOT_FAIL",
            "DEADLINE",
            "PREEMPTED",
        }
        until = until or (lambda j: j["JobState"] in ended)
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if until(job):
                return job
            if time.monotonic() > deadline:
                raise SlurmError(
                    f"job {job_id} still {job.get('JobState')} after {timeout:.0f} s: {job}\n"
                    f"{self.logs()}"
                )
            time.sleep(0.5)

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace")[-tail:]
            parts.append(f"--- {path.name}\n{text}")
        return "\n".join(parts)

    # -- teardown -----------------------------------------------------------------------------------------------
    def _cluster_pids(self) -> list[int]:
        """Processes started by this cluster (slurmstepd, job tasks): their environment names our slurm.conf."""
        marker = f"SLURM_CONF={self.conf}".encode()
        mine = {os.getpid(), *(p.pid for _, p in self._daemons)}
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in mine:
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0") and int(entry.name) not in _ancestors():
                pids.append(int(entry.name))
        return pids

    def stop(self) -> None:
        if any(name == "slurmctld" and p.poll() is None for name, p in self._daemons):
            self.run(["scancel", "--user", str(os.getuid())], check=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                queue = self.run(["squeue", "--noheader"], check=False)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(0.5)
        for _name, proc in reversed(self._daemons):  # slurmd, slurmctld, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        for pid in self._cluster_pids():  # a slurmstepd or task that outlived its slurmd
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._daemons.clear()


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pids
