"""Nodes a run found bad, kept in its run dir so that the next attempt leaves them out.

`bad_nodes.json` holds one entry per node and reason: the node's name (SLURM's name for it under SLURM, else the
host name), why (`preflight`, `hang`, `checksum`, `straggler`), the step, the evidence, and when. Whoever sees
the fault records it (rank 0 for the world's findings: preflight's verdict, a checksum mismatch, a straggler); a
hang is decided after the fact from every rank's own hang record (`hang_suspects`), because at that moment each
rank knows only whether it was itself waiting on its peers. The requeue of `keel slurm` passes the nodes to
`--exclude` (keel/launcher/slurm_requeue.py), `keel train --hostfile` drops them. Entries are only ever added: to
give a node back, delete its entry (or the file).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from keel.config import ConfigError
from keel.run_dir import RunDir, read_anomalies, write_atomic

REASONS = ("preflight", "hang", "checksum", "straggler")
# hang records of one event: every rank's watchdog fires within seconds of the others (watchdog.PEER_WINDOW_S)
HANG_WINDOW_S = 60.0


@dataclass(frozen=True)
class BadNode:
    host: str
    reason: str  # one of REASONS
    step: int
    evidence: dict[str, Any] = field(default_factory=dict)
    time: float = 0.0


class BadNodesError(ConfigError):
    """bad_nodes.json exists but cannot be read: one line saying which file and what to do."""


def read_bad_nodes(run_dir: Path) -> list[BadNode]:
    path = RunDir(run_dir).bad_nodes
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text())["nodes"]
        return [BadNode(**entry) for entry in entries]
    except (ValueError, KeyError, TypeError) as err:
        raise BadNodesError(
            f"{path} is not a bad-node list ({err}); fix or delete it (deleting gives every node back)"
        ) from None


def record_bad_nodes(run_dir: Path, found: list[BadNode]) -> list[BadNode]:
    """Add `found` to the run dir's list (atomically; an entry already there for the same node, reason and step
    is not added twice); returns the entries that were new."""
    known = read_bad_nodes(run_dir)
    seen = {(n.host, n.reason, n.step) for n in known}
    new = []
    for node in found:
        if node.reason not in REASONS:
            raise ValueError(
                f"bad node reason {node.reason!r}: expected one of {', '.join(REASONS)}"
            )
        if (node.host, node.reason, node.step) not in seen:
            seen.add((node.host, node.reason, node.step))
            new.append(node if node.time else BadNode(**{**asdict(node), "time": time.time()}))
    if new:
        path = RunDir(run_dir).bad_nodes
        path.parent.mkdir(parents=True, exist_ok=True)
        nodes = [asdict(n) for n in known + new]
        write_atomic(path, json.dumps({"nodes": nodes}, indent=1, default=str) + "\n")
    return new


def record_bad_node(
    run_dir: Path, host: str, reason: str, step: int, **evidence: Any
) -> BadNode | None:
    """One node; returns its entry, or None when it was already recorded."""
    new = record_bad_nodes(run_dir, [BadNode(host, reason, step, evidence)])
    return new[0] if new else None


def hang_suspects(events: list[dict[str, Any]]) -> list[BadNode]:
    """The nodes of the ranks that hung, from the watchdog's hang records (one per rank and hang).

    A rank's record says whether the rank was waiting on its peers (in a collective, or a collective failed
    under it because a peer was gone) or stuck in its own work. Of one hang (records of one step within
    HANG_WINDOW_S), the stuck ranks are suspects only when they are at most as many as the waiting ones: when
    most ranks look stuck (NCCL's collectives return at once and the ranks wait later, in a device read),
    nobody is to blame from here, and nobody is recorded."""
    hangs = sorted(
        (e for e in events if e.get("kind") == "hang" and "waiting" in e),
        key=lambda e: e.get("time", 0.0),
    )
    groups: list[list[dict[str, Any]]] = []
    for event in hangs:
        last = groups[-1] if groups else None
        if (
            last
            and event.get("step") == last[0].get("step")
            and event.get("time", 0.0) - last[0].get("time", 0.0) <= HANG_WINDOW_S
        ):
            last.append(event)
        else:
            groups.append([event])
    suspects = []
    for group in groups:
        waiting = [e for e in group if e["waiting"]]
        stuck = [e for e in group if not e["waiting"]]
        if not waiting or not stuck or len(stuck) > len(waiting):
            continue
        for event in stuck:
            evidence = {
                "rank": event.get("rank"),
                "phase": event.get("phase"),
                "seconds": event.get("seconds"),
                "stacks": event.get("stacks"),
                "ranks_waiting": len(waiting),
            }
            suspects.append(
                BadNode(str(event.get("host")), "hang", int(event.get("step", 0)), evidence)
            )
    return suspects


def collect(run_dir: Path) -> list[BadNode]:
    """Record the hang suspects the run dir's anomaly log holds (idempotent); returns every recorded entry.
    What the next attempt calls before it chooses its nodes."""
    record_bad_nodes(run_dir, hang_suspects(read_anomalies(run_dir)))
    return read_bad_nodes(run_dir)


def bad_hosts(run_dir: Path) -> list[str]:
    """Every recorded node's name (the anomaly log's hang suspects collected first), each once, in the order they
    were found: what the next attempt leaves out."""
    return list(dict.fromkeys(node.host for node in collect(run_dir)))
