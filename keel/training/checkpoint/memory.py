"""In-memory checkpoints (`checkpoint.memory_interval`): every N steps each rank's whole training state in host
memory that outlives its process, plus a copy on a buddy rank on the next node. A restart restores the newest
step every rank can get from memory, and falls back to the disk checkpoint otherwise.

Where: `<checkpoint.memory_dir>/keel-<run id>/<node>/` (a tmpfs, /dev/shm by default: memory that survives the
process though not the node), two kinds of file, each counted only with its JSON sidecar:
    own-rank<R>-step<N>.pt      rank R's state at step N, written by rank R on this node
    copy-rank<R>-step<N>.pt     rank R's state at step N, received from R on another node
The sidecar holds the run's id and directory, the layout, the step, and the file's size and chunk sha256s: a
snapshot is restored only into the run and the layout that wrote it, and only when its bytes match.

A snapshot holds the engine's per-rank state (keel/adapters/deepspeed_internals `engine_state`: this rank's module,
ZeRO partition, LR scheduler and counters — not DeepSpeed's checkpoint files, some of which one rank of a
data-parallel group writes for all of them), Keel's train state and guards, and every RNG stream: a rank restores
from its own bytes alone, whichever node holds them.

Taking one: `torch.save` into the tmpfs on the main thread at the step (one host copy of the rank's state, as an
async save's snapshot is), then on one thread — overlapped with the next steps — the hash, the sidecar, the rename,
and the exchange: the file to the buddy (the same local rank on the next node), the file of the rank whose buddy
this one is received, over a group of the pair alone; a copy that arrives whole replaces the older copy. The older
own snapshot goes once the step's agreement (step_gate.py) says every rank's newest is whole: a rank lost
mid-snapshot leaves the previous step with every rank. Host memory: the rank's state × 2 (its own and a copy), × 4
at the peak while one is taken, in the memory model. On one node there is no buddy: a snapshot then survives its
process, not its node.

A restart (torchrun's elastic restart, a SLURM requeue, a replaced node), before the engine is built: rank 0
gathers what each node holds, picks the newest step that every rank can get — from its own node, else a copy
from another — no older than the newest complete disk checkpoint, and scatters one entry per rank (read here, or
receive from rank S; send these to ranks D). The copies travel over the world's control group, each rank verifies
its file, and one all-reduce says whether every rank loads from memory; otherwise every rank loads from disk. Both
are logged, with why.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from keel.adapters.deepspeed_internals import engine_state, load_engine_state
from keel.parallel import comm
from keel.parallel.topology import Topology
from keel.run_dir import AnomalyLog, node_name, read_run_id, write_atomic
from keel.training.checkpoint import rng_state, verify
from keel.training.checkpoint.store import TrainState

log = logging.getLogger("keel")

PURPOSE = "keel-memory"  # the buddy pairs' own process groups (keel/parallel/process_groups.py)
_FILE = re.compile(r"(own|copy)-rank(\d+)-step(\d+)\.pt")
_PIECE = 256 << 20  # bytes per point-to-point message


def snapshot_name(kind: str, owner: int, step: int) -> str:
    return f"{kind}-rank{owner}-step{step:08d}.pt"


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


@dataclass
class Restore:
    """What a restart restores from memory, agreed: `step`, this rank's verified file, and for the log how many
    ranks read their node's file, how many received a copy, and the bytes sent."""

    step: int
    path: Path
    local: int = 0
    received: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0


@dataclass
class _Entry:
    """One rank's part of a restore plan (rank 0 scatters one per rank)."""

    step: int | None = None
    read: str = ""  # this node's file of this rank's state
    receive_from: int = -1  # else: the rank that sends it
    send: list[tuple[int, str]] = field(default_factory=list)  # (to rank, file on this node)
    why: str = ""  # no step: why not


class MemoryCheckpoints:
    """One run's in-memory snapshots on this rank. `agree` and `discard_after` are collective over the world;
    `snapshot` is too in effect (the buddies exchange), so every rank takes the same snapshots."""

    def __init__(
        self,
        directory: Path,
        interval: int,
        topology: Topology,
        run_dir: Path,
        anomalies: AnomalyLog | None = None,
    ):
        self.interval, self.topology, self.anomalies = interval, topology, anomalies
        self.rank, self.world = topology.rank, topology.shape.world_size
        self.run_dir = str(Path(run_dir).resolve())
        self.run_id = read_run_id(run_dir)
        self.node = node_name()
        self.store = Path(directory) / f"keel-{self.run_id}" / self.node
        self.layout = topology.stamp()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        # the same local rank on the next node; none on one node (a copy there guards nothing the own file does not)
        self.buddy = (self.rank + per_node) % self.world if per_node < self.world else None
        self.sender = (self.rank - per_node) % self.world if per_node < self.world else None
        self._pairs: dict[int, Any] = {}
        if (
            self.buddy is not None
        ):  # in one global order: every member meets its pairs in the same sequence
            for pair in sorted(
                {tuple(sorted(p)) for p in ((self.rank, self.buddy), (self.sender, self.rank))}
            ):
                group = topology.process_groups.private(pair, PURPOSE)
                self._pairs[pair[0] if pair[1] == self.rank else pair[1]] = group
        self.restored: Restore | None = None
        self._thread: threading.Thread | None = None
        self._failure = ""
        self._failed = (
            False  # the last snapshot failed (the step's agreement then keeps the older ones)
        )
        self._unsettled = False  # a snapshot was taken since the older ones were last dropped

    # -- taking snapshots -----------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def snapshot(self, engine, state: TrainState, guards: dict[str, Any]) -> float:
        """This rank's state at `state.step` into the tmpfs now, the rest in the background; returns the seconds
        training waited (the previous snapshot's thread first, then the copy)."""
        started = time.perf_counter()
        self.wait()
        step = state.step
        path = self.store / snapshot_name("own", self.rank, step)
        partial = path.with_name("." + path.name)
        payload = {
            "engine": engine_state(engine),
            "keel": asdict(state),
            "guards": guards,
            "rng": rng_state.capture(engine.module),
        }
        failure = ""
        try:
            self.store.mkdir(parents=True, exist_ok=True)
            torch.save(payload, partial)
        except OSError as exc:  # a full tmpfs: this snapshot is lost, training is not
            partial.unlink(missing_ok=True)
            failure = f"writing {partial}: {exc.strerror or exc}"
        self._failed, self._unsettled = False, True
        self._thread = threading.Thread(
            target=self._finish,
            args=(path, partial, step, failure),
            name="keel-memory",
            daemon=True,
        )
        self._thread.start()
        return time.perf_counter() - started

    def wait(self) -> None:
        """The snapshot in flight is done (kept and exchanged, or failed: said once, in the log and anomalies)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failure:
            failure, self._failure = self._failure, ""
            log.warning("in-memory snapshot failed on rank %d: %s", self.rank, failure)
            if self.anomalies is not None:
                self.anomalies.record("memory_snapshot_failed", 0, reason=failure)

    def _finish(self, path: Path, partial: Path, step: int, failure: str) -> None:
        """The background half: hash, sidecar, rename, then the buddy exchange (which
        runs even after a failure here, so that the pair's messages stay paired)."""
        try:
            meta = None
            if not failure:
                size, chunks = verify.describe(partial)
                meta = self._meta(step, self.rank, size, chunks)
                write_atomic(_sidecar(path), json.dumps(meta) + "\n")
                partial.replace(path)
            if self.buddy is not None:
                failure = self._exchange(path if meta else None, meta, step) or failure
        except Exception as exc:  # reported by `wait` on the main thread
            failure = failure or f"{type(exc).__name__}: {exc}"
        self._failure = failure
        self._failed = bool(failure)

    def state(self) -> int:
        """This rank's part of the step's agreement: 2 a snapshot is in flight, 1 the last one failed, 0 whole."""
        if self._thread is not None and self._thread.is_alive():
            return 2
        return 1 if self._failed else 0

    def settle(self) -> None:
        """Every rank's newest snapshot is whole (the step's agreement said so): this rank's older own ones go.
        Kept until then, so that a rank lost while the others' newest is in flight leaves a step all of them
        hold; a copy replaces the older copy as soon as it arrives whole."""
        if self._unsettled:
            self._unsettled = False
            own = [
                step for owner, step, path in self.held() if owner == self.rank and "/own-" in path
            ]
            if own:
                self._drop("own", self.rank, keep=max(own))

    def _meta(self, step: int, owner: int, size: int, chunks: list[str]) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "layout": self.layout,
            "step": step,
            "owner": owner,
            "size": size,
            "chunk_bytes": verify.CHUNK_HASH_BYTES,
            "chunks": chunks,
        }

    def _exchange(self, path: Path | None, meta: dict | None, step: int) -> str:
        """Send this rank's snapshot to its buddy, receive its sender's (each over the pair's own group): the
        sidecar first (empty: nothing to send), then the bytes. Returns a failure, or ""."""
        out = json.dumps(meta).encode() if meta else b""
        header_out = torch.tensor([len(out)], dtype=torch.int64)
        header_in = torch.zeros(1, dtype=torch.int64)
        _wait(
            [
                comm.post_send(header_out, self.buddy, self._pairs[self.buddy]),
                comm.post_recv(header_in, self.sender, self._pairs[self.sender]),
            ]
        )
        meta_in = torch.empty(int(header_in), dtype=torch.uint8)
        works = [comm.post_recv(meta_in, self.sender, self._pairs[self.sender])]
        if out:
            works.append(comm.post_send(_bytes(out), self.buddy, self._pairs[self.buddy]))
        _wait(works)
        received = json.loads(bytes(meta_in.numpy())) if int(header_in) else None
        works = (
            []
            if path is None
            else _post_sends(_file_bytes(path), self.buddy, self._pairs[self.buddy])
        )
        if received is None:
            _wait(works)
            return ""
        copy = self.store / snapshot_name("copy", self.sender, received["step"])
        partial = copy.with_name("." + copy.name)
        target = _file_bytes(partial, received["size"])
        _wait(works + _post_receives(target, self.sender, self._pairs[self.sender]))
        del target
        if verify.describe(partial) != (received["size"], received["chunks"]):
            partial.unlink(missing_ok=True)
            return f"the copy of rank {self.sender}'s step {received['step']} arrived damaged"
        write_atomic(_sidecar(copy), json.dumps(received) + "\n")
        partial.replace(copy)
        self._drop("copy", self.sender, keep=received["step"])
        return ""

    def _drop(
        self, kind: str, owner: int, keep: int | None = None, after: int | None = None
    ) -> None:
        """Remove `owner`'s `kind` snapshots here: all but step `keep`, or (`after`) those newer than it."""
        for path in self.store.glob(f"{kind}-rank{owner}-step*.pt"):
            step = int(_FILE.fullmatch(path.name).group(3)) if _FILE.fullmatch(path.name) else None
            if step is None or (keep is not None and step == keep):
                continue
            if after is not None and step <= after:
                continue
            _sidecar(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)

    def discard_after(self, step: int) -> None:
        """Every rank: the snapshots this rank wrote or holds of steps after `step` go (a rollback or a restore
        to `step` leaves them on an abandoned path, which a later restart must not take)."""
        self.wait()
        self._drop("own", self.rank, after=step)
        if self.sender is not None:
            self._drop("copy", self.sender, after=step)

    def clear(self) -> None:
        """A clean end: this rank's snapshots and the copy it holds go, then the run's directories if empty."""
        self.wait()
        self._drop("own", self.rank, after=-1)
        if self.sender is not None:
            self._drop("copy", self.sender, after=-1)
        for directory in (self.store, self.store.parent):
            try:
                directory.rmdir()
            except OSError:
                pass

    # -- restoring ------------------------------------------------------------------------------------------------
    def held(self) -> list[tuple[int, int, str]]:
        """(owner rank, step, path) of every whole snapshot of this run and layout on this node (sidecar read,
        bytes not yet checked)."""
        found = []
        if not self.store.is_dir():
            return found
        for path in sorted(self.store.glob("*.pt")):
            match = _FILE.fullmatch(path.name)
            try:
                meta = json.loads(_sidecar(path).read_text()) if match else None
            except (OSError, ValueError):
                continue
            if meta is None or not self._ours(meta, int(match.group(2)), int(match.group(3))):
                continue
            if path.stat().st_size == meta["size"]:
                found.append((meta["owner"], meta["step"], str(path)))
        return found

    def _ours(self, meta: dict, owner: int, step: int) -> bool:
        return (
            meta.get("run_id") == self.run_id
            and meta.get("run_dir") == self.run_dir
            and meta.get("layout") == self.layout
            and (meta.get("owner"), meta.get("step")) == (owner, step)
        )

    def agree(self, disk_step: int | None) -> Restore | None:
        """Collective over the world: the step every rank restores from memory, with this rank's file verified
        here, or None (every rank loads from disk). `disk_step`: the newest complete disk checkpoint's step as
        rank 0 sees it (None: none), read on rank 0 only."""
        started = time.perf_counter()
        control = self.topology.control("world")
        # one listing per node: the first local rank's
        listing = self.held() if os.environ.get("LOCAL_RANK", "0") == "0" else None
        reports = comm.gather_object((self.node, listing), control)
        plan = _plan(reports, disk_step, self.world) if reports is not None else None
        entry: _Entry = comm.scatter_object(plan, control)
        if entry.step is None:
            if self.rank == 0 and entry.why:
                log.info("in-memory snapshots: %s — restoring from disk", entry.why)
            return None
        path, moved, failure = self._fetch(entry, control)
        if not failure:
            size, chunks = verify.describe(path)
            meta = json.loads(_sidecar(path).read_text())
            if (size, chunks) != (meta["size"], meta["chunks"]):
                failure = f"{path} does not match its sidecar (size or sha256)"
        failures = comm.gather_object(failure, control)
        first = next((f"rank {r}: {f}" for r, f in enumerate(failures or []) if f), "")
        first = comm.broadcast_object(first, control)
        if first:
            if self.rank == 0:
                log.warning(
                    "in-memory step %d cannot be restored (%s) — restoring from disk",
                    entry.step,
                    first,
                )
            return None
        counts = torch.tensor(
            [int(bool(entry.read)), int(entry.receive_from >= 0), moved], dtype=torch.int64
        )
        comm.all_reduce(counts, control)
        self.restored = Restore(
            entry.step,
            path,
            int(counts[0]),
            int(counts[1]),
            int(counts[2]),
            time.perf_counter() - started,
        )
        return self.restored

    def _fetch(self, entry: _Entry, control: comm.Group) -> tuple[Path, int, str]:
        """This rank's file for `entry.step`: its node's, or received (and the copies it sends sent). Returns
        (the file, bytes this rank sent, a failure or "")."""
        handle = control.handle
        sends = [(to, Path(path)) for to, path in entry.send]
        headers = [(to, _bytes(_sidecar(p).read_bytes())) for to, p in sends]
        works = [
            comm.post_send(torch.tensor([len(h)], dtype=torch.int64), to, handle)
            for to, h in headers
        ]
        length = torch.zeros(1, dtype=torch.int64)
        if entry.receive_from >= 0:
            works.append(comm.post_recv(length, entry.receive_from, handle))
        _wait(works)
        works = [comm.post_send(h, to, handle) for to, h in headers]
        meta_in = torch.empty(int(length), dtype=torch.uint8)
        if entry.receive_from >= 0:
            works.append(comm.post_recv(meta_in, entry.receive_from, handle))
        _wait(works)
        moved = sum(p.stat().st_size for _, p in sends)
        works = [w for to, p in sends for w in _post_sends(_file_bytes(p), to, handle)]
        if entry.receive_from < 0:
            _wait(works)
            return Path(entry.read), moved, ""
        meta = json.loads(bytes(meta_in.numpy()))
        # the copy becomes this node's own snapshot of this rank's state
        path = self.store / snapshot_name("own", self.rank, entry.step)
        partial = path.with_name("." + path.name)
        self.store.mkdir(parents=True, exist_ok=True)
        target = _file_bytes(partial, meta["size"])
        _wait(works + _post_receives(target, entry.receive_from, handle))
        del target
        write_atomic(_sidecar(path), json.dumps(meta) + "\n")
        partial.replace(path)
        return path, moved, ""

    def load(self, engine, restore: Restore) -> tuple[TrainState, dict[str, Any]]:
        """Restore engine, RNG and train state from the agreed snapshot; returns (train state, guards' state).
        The file is mapped, not read (its pages are memory already): weights and partitions are copied into the
        engine's tensors from the mapping; the optimizer's moments keep the mapped tensors, privately (a write
        copies the page, the file never changes), until the first step has written every page of them."""
        payload = torch.load(restore.path, map_location="cpu", weights_only=False, mmap=True)
        load_engine_state(engine, payload["engine"])
        rng_state.restore(payload["rng"], engine.module)
        return TrainState(**payload["keel"]), payload["guards"]


def _plan(
    reports: list[tuple[str, list[tuple[int, int, str]] | None]], disk_step: int | None, world: int
) -> list[_Entry]:
    """Rank 0: one entry per rank — the newest step every rank can get, no older than `disk_step`, each rank
    reading its node's file where it has one, else receiving from a rank on a node that has it (spread over that
    node's ranks)."""
    node_of = [node for node, _ in reports]
    ranks_on: dict[str, list[int]] = {}
    for rank, node in enumerate(node_of):
        ranks_on.setdefault(node, []).append(rank)
    holders: dict[tuple[int, int], dict[str, str]] = {}
    for node, listing in reports:
        for owner, step, path in listing or []:
            holders.setdefault((owner, step), {})[node] = path
    steps = sorted({step for _, step in holders}, reverse=True)
    floor = -1 if disk_step is None else disk_step
    why = "none held for this run and layout"
    for step in steps:
        if step < floor:
            why = f"the newest, step {steps[0]}, is older than the disk checkpoint of step {floor}"
            break
        missing = [owner for owner in range(world) if (owner, step) not in holders]
        if missing:
            why = f"step {step} is held for {world - len(missing)} of {world} ranks (none of rank {missing[0]}'s)"
            continue
        entries = [_Entry(step) for _ in range(world)]
        sent: dict[int, int] = {}
        for owner in range(world):
            held = holders[owner, step]
            if node_of[owner] in held:
                entries[owner].read = held[node_of[owner]]
                continue
            node = sorted(held)[0]
            sender = min(ranks_on[node], key=lambda r: (sent.get(r, 0), r))
            sent[sender] = sent.get(sender, 0) + 1
            entries[owner].receive_from = sender
            entries[sender].send.append((owner, held[node]))
        return entries
    return [_Entry(why=why) for _ in range(world)]


# -- bytes between ranks (gloo sends CPU tensors; a file's pages are sent and received in place) ---------------
def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _file_bytes(path: Path, size: int | None = None) -> torch.Tensor:
    """A file's bytes as a uint8 tensor over its pages, mapped shared (no copy: what is received into it lands in
    the file); `size`: a new file of that many bytes."""
    if size is not None:
        with open(path, "wb") as f:
            f.truncate(size)
    size = path.stat().st_size
    if not size:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def _post_sends(source: torch.Tensor, to: int, group) -> list:
    return [
        comm.post_send(source[i : i + _PIECE], to, group) for i in range(0, source.numel(), _PIECE)
    ]


def _post_receives(target: torch.Tensor, source: int, group) -> list:
    return [
        comm.post_recv(target[i : i + _PIECE], source, group)
        for i in range(0, target.numel(), _PIECE)
    ]
