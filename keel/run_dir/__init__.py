"""The run dir: every file a run writes, named once; its reader; atomic writes; the anomaly log; exit codes.

Everything a run did is in its run dir, and this module is the only place that spells a file name in it or an
exit-code number. It sits at the bottom of the house (it imports only `keel.config`), so the launcher that writes
a run dir, the ranks that read it and the tools that read it afterwards all name the same files.
"""

from __future__ import annotations

import enum
import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.config import RunConfig, build_config
from keel.config.yaml_text import parse_yaml


class ExitCode(enum.IntEnum):
    """Keel's process exit codes, read by the launcher (SLURM requeues on PREEMPTED) and by whoever reads its log.

    ====  ==============  ==========================================================================================
    code  name            meaning
    ====  ==============  ==========================================================================================
    0     OK              the run finished
    1     FAILED          an exception on the rank (or repeated non-finite steps with nothing to roll back to)
    2     USAGE           a usage or config error, reported before any rank starts;
          BAD_DATA        or a token id outside the vocabulary at the sample: every rank stops at that step
    3     CHECKSUM        parameter checksum mismatch: data-parallel replicas diverged, stopped
    4     HANG            a step (or a check, evaluation or save) overran its watchdog timeout; stacks in `stacks/`
    5     PREEMPTED       checkpoint saved on SIGUSR1/SIGTERM; requeue the job
    6     CHECKPOINT      no checkpoint to load as agreed: ranks disagree on it, or every one is corrupt
                          (set aside as `.corrupt`)
    7     CORRUPT_STATE   non-finite weights or optimizer state with no checkpoint to return to, coming back after
                          a rollback, or at the end of the run
    8     SAVE_FAILED     a checkpoint save failed and the run stops (`checkpoint.on_save_error: stop`, or the
                          final save)
    9     PREFLIGHT       preflight found bad ranks (named in its table and `preflight.json`), or too few nodes
                          remain once the recorded bad ones are left out (keel/run_dir/bad_nodes.py)
    ====  ==============  ==========================================================================================
    """

    OK = 0
    FAILED = 1
    USAGE = 2
    BAD_DATA = 2  # the same code as USAGE: bad input, found at the sample instead of before launch
    CHECKSUM = 3
    HANG = 4
    PREEMPTED = 5
    CHECKPOINT = 6
    CORRUPT_STATE = 7
    SAVE_FAILED = 8
    PREFLIGHT = 9


# Inside `checkpoints/`: the pointer to the newest committed tag, the marker (and manifest) that commits a tag,
# and the tags themselves (`step00000100`); DeepSpeed's universal conversion goes beside the tag it came from.
LATEST = "latest"
COMPLETE = "keel_complete.json"
UNIVERSAL = "universal"
TAG = re.compile(r"step\d{8}")


def tag_for(step: int) -> str:
    """The checkpoint directory name of optimizer step `step`."""
    return f"step{step:08d}"


def step_of(tag: str) -> int:
    """The optimizer step of checkpoint tag `tag` (`tag_for`'s inverse)."""
    if not TAG.fullmatch(tag):
        raise ValueError(f"{tag!r} is not a checkpoint tag (step followed by 8 digits)")
    return int(tag.removeprefix("step"))


@dataclass(frozen=True)
class RunDir:
    """Where everything a run writes lives. Directories are created by whoever writes into them first."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(
        self,
    ) -> Path:  # the resolved RunConfig, written by the launcher before any rank starts
        return self.root / "config.yaml"

    @property
    def ds_config(self) -> Path:  # the DeepSpeed JSON as the user wrote it
        return self.root / "ds_config.json"

    @property
    def data(self) -> Path:  # the prepared tokenizer and token files, and which tokenizer it was
        return self.root / "data.json"

    @property
    def run_id(
        self,
    ) -> Path:  # the run's identity, made once with the run dir (keys its in-memory snapshots)
        return self.root / "run_id.txt"

    @property
    def metrics(self) -> Path:  # one JSON record per logged step
        return self.root / "metrics.jsonl"

    @property
    def metrics_discarded(self) -> Path:  # records of steps a rollback undid
        return self.root / "metrics.discarded.jsonl"

    @property
    def timeline(
        self,
    ) -> Path:  # each launch's start-up phases and end (keel/training/observe/timeline.py)
        return self.root / "timeline.jsonl"

    @property
    def anomalies(self) -> Path:  # one JSON event per line (AnomalyLog)
        return self.root / "anomalies.jsonl"

    @property
    def summary(self) -> Path:  # how the run ended, for a person
        return self.root / "summary.md"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def preflight(self) -> Path:  # `keel preflight`'s verdict
        return self.root / "preflight.json"

    @property
    def bad_nodes(self) -> Path:  # nodes the next attempt leaves out (keel/run_dir/bad_nodes.py)
        return self.root / "bad_nodes.json"

    @property
    def report(self) -> Path:  # `keel report`'s default output directory
        return self.root / "report"

    @property
    def collectives(self) -> Path:  # per-rank collective traces (logging.collective_trace)
        return self.root / "collectives"

    @property
    def stacks(self) -> Path:  # the watchdog's stack dumps, one file per rank and hang
        return self.root / "stacks"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb_id(self) -> Path:  # the W&B run id, so a resumed run continues the same W&B run
        return self.root / "wandb_id.txt"

    def hang_stacks(self, rank: int, step: int) -> Path:
        return self.stacks / f"rank{rank}-step{step}.txt"


@dataclass
class RunSpec:
    """A run as the launcher built it from the command line: what `write_run_dir` writes and the tools read."""

    cfg: RunConfig
    ds_raw: dict[str, Any]
    run_dir: Path
    data: dict[str, Any] = field(default_factory=dict)  # filled by prepare_data
    base_dir: Path | None = None  # relative corpus paths are read from the config file's directory
    world_size: int = 1


def checkpoint_dir(run_dir: Path, cfg: RunConfig, rank: int) -> Path:
    """`<run_dir>/checkpoints`, or for `faults.checkpoint_dir_rank` the directory `faults.checkpoint_dir` (a
    rehearsal of a stale shared-filesystem view: that rank reads another copy of the checkpoints)."""
    faults = cfg.faults
    if faults.checkpoint_dir and faults.checkpoint_dir_rank == rank:
        return Path(faults.checkpoint_dir)
    return RunDir(run_dir).checkpoints


def has_checkpoint(run_dir: Path) -> bool:
    """Whether the run dir holds a committed checkpoint to resume from."""
    return (RunDir(run_dir).checkpoints / LATEST).is_file()


def read_run_id(run_dir: Path) -> str:
    """The run's id, written once by the launcher with the run dir; a run dir from before run ids gets one now
    (its first reader writes it; a racing reader's is replaced by the same rename, and both then read the file)."""
    path = RunDir(run_dir).run_id
    if not path.is_file():
        try:
            path.open("x").close()  # only the first creator writes the id
            write_atomic(path, uuid.uuid4().hex + "\n")
        except FileExistsError:
            pass
    for _ in range(100):  # the creator's rename follows its creation at once
        text = path.read_text().strip()
        if text:
            return text
        time.sleep(0.05)
    raise RuntimeError(f"{path} is empty: delete it and start again")


def read_run_dir(run_dir: Path) -> tuple[RunConfig, dict[str, Any], dict[str, Any]]:
    """The run's config, DeepSpeed JSON and data record, as the launcher wrote them."""
    layout = RunDir(run_dir)
    cfg = build_config(parse_yaml(layout.config.read_text()))
    ds_raw = json.loads(layout.ds_config.read_text())
    data = json.loads(layout.data.read_text())
    return cfg, ds_raw, data


def node_name() -> str:
    """This process's node as the scheduler names it: SLURM's node name under SLURM (several nodes may share
    one host name, as on a test cluster of virtual nodes), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def temp_sibling(path: Path) -> Path:
    """A unique hidden name next to `path` (same filesystem, so os.replace is atomic)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write `data` to `path` via a synced temporary file and a rename: a reader sees either the old file or the
    complete new one, never a partial one."""
    payload = data.encode() if isinstance(data, str) else data
    tmp = temp_sibling(path)
    try:
        with open(tmp, "xb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class AnomalyLog:
    """`<run_dir>/anomalies.jsonl`: one JSON object per event, each with a `kind`; written by rank 0 only
    unless `all_ranks` (events only one rank can see, e.g. a hang on that rank)."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir = Path(run_dir)
        self.path = RunDir(run_dir).anomalies
        self.rank = rank
        self.events: list[dict[str, Any]] = []  # this process's events, for the end-of-run summary

    def record(
        self, kind: str, step: int, all_ranks: bool = False, **fields: Any
    ) -> dict[str, Any]:
        event = {
            "kind": kind,
            "step": step,
            "time": time.time(),
            "rank": self.rank,
            "host": node_name(),
            **fields,
        }
        self.events.append(event)
        if self.rank == 0 or all_ranks:
            # one short line per write: appends of whole lines do not interleave
            with open(self.path, "a") as f:
                f.write(json.dumps(event, default=str) + "\n")
        return event


def read_anomalies(run_dir: Path) -> list[dict[str, Any]]:
    path = RunDir(run_dir).anomalies
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
