"""Checkpoints: DeepSpeed's files plus Keel's client state, made "latest" only once every rank has written.

Layout of `<run_dir>/checkpoints/`:
    step00000100/            DeepSpeed's model/optimizer files for that step (its own format)
        keel_rng_rank<R>.pt  each rank's RNG streams (keel/training/rng_state.py)
        keel_complete.json   written by rank 0 after a barrier: the checkpoint is whole; lists every file and size
    latest                   DeepSpeed's pointer file, replaced atomically after keel_complete.json exists

A crash mid-save leaves a directory without `keel_complete.json`; it is never loaded and is overwritten when
that step is saved again.

Which checkpoint to load is chosen once: rank 0 reads the directory, broadcasts the tag and a digest of its
manifest, every rank checks that its own view holds that checkpoint whole (same manifest, every listed file at its
size, its RNG file), and one all-gather of the verdicts makes every rank stop together (`CheckpointDisagreement`,
exit code 6) when any rank does not — a stale view of a shared filesystem must not load another step's state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keel.config import RunConfig
from keel.parallel import comm
from keel.parallel.topology import Topology
from keel.training import rng_state

COMPLETE = "keel_complete.json"
UNIVERSAL = "universal"
LATEST = "latest"
EXIT_CHECKPOINT = 6  # ranks disagree on the checkpoint to load (see the exit-code table in watchdog.py)

log = logging.getLogger("keel")


class CheckpointDisagreement(RuntimeError):
    """Some rank does not see the checkpoint rank 0 chose, whole; every rank raises it with the same message."""

    exit_code = EXIT_CHECKPOINT


def checkpoint_dir(run_dir: Path, cfg: RunConfig, rank: int) -> Path:
    """`<run_dir>/checkpoints`, or for `faults.checkpoint_dir_rank` the directory `faults.checkpoint_dir` (a
    rehearsal of a stale shared-filesystem view: that rank reads another copy of the checkpoints)."""
    f = cfg.faults
    if f.checkpoint_dir and f.checkpoint_dir_rank == rank:
        return Path(f.checkpoint_dir)
    return Path(run_dir) / "checkpoints"


@dataclass
class TrainState:
    """Where the run is: optimizer steps taken and global samples consumed (the data position)."""

    step: int = 0
    consumed_samples: int = 0
    lr_scale: float = 1.0  # halved by each spike rollback
    rollbacks: int = 0
    skipped_steps: int = 0


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def tag_for(step: int) -> str:
    return f"step{step:08d}"


class Checkpointer:
    def __init__(self, directory: Path, keep_last: int, topology: Topology):
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.topology = topology
        self.control = topology.control("world")

    # -- discovery ------------------------------------------------------------------------------------------
    def tag_at_or_before(self, step: int) -> str | None:
        """The newest complete checkpoint written at or before `step` (the last healthy one for a rollback)."""
        tags = [t for t in self.complete_tags() if self.read_manifest(t)["step"] <= step]
        return tags[-1] if tags else None

    def complete_tags(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return sorted(p.name for p in self.directory.iterdir() if (p / COMPLETE).is_file())

    def latest_tag(self) -> str | None:
        """The tag `latest` names if it is complete, else the newest complete one (never a half-written one)."""
        pointer = self.directory / LATEST
        if pointer.is_file():
            tag = pointer.read_text().strip()
            if (self.directory / tag / COMPLETE).is_file():
                return tag
        tags = self.complete_tags()
        return tags[-1] if tags else None

    def read_manifest(self, tag: str) -> dict[str, Any]:
        return json.loads((self.directory / tag / COMPLETE).read_text())

    # -- the one choice every rank loads ------------------------------------------------------------------
    def agreed_latest(self) -> str | None:
        """`latest_tag()` as rank 0 sees it, verified on every rank (collective over the world)."""
        return self.agree_on(self.latest_tag() if self.topology.rank == 0 else None)

    def agreed_at_or_before(self, step: int) -> str | None:
        """`tag_at_or_before(step)` as rank 0 sees it, verified on every rank (collective over the world)."""
        return self.agree_on(self.tag_at_or_before(step) if self.topology.rank == 0 else None)

    def agree_on(self, tag: str | None) -> str | None:
        """Rank 0's `tag` (other ranks' argument is ignored) once every rank has checked it sees that checkpoint
        whole; raises CheckpointDisagreement on every rank otherwise. None: rank 0 has nothing to load."""
        offer = {"tag": tag, "manifest": self._digest(tag)} if self.topology.rank == 0 and tag else None
        offer = comm.broadcast_object(offer, self.control)
        problem = self._problem(offer["tag"], offer["manifest"]) if offer else ""
        verdicts = comm.all_gather_object(problem, self.control)
        bad = [f"rank {r}: {p}" for r, p in zip(self.control.ranks, verdicts) if p]
        if bad:
            more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
            raise CheckpointDisagreement(
                f"checkpoint {offer['tag']} chosen by rank 0 is not whole on every rank — {bad[0]}{more}; every "
                "rank must see the same checkpoint directory (a stale or different shared-filesystem view?)")
        return offer["tag"] if offer else None

    def _digest(self, tag: str) -> str:
        return hashlib.sha256((self.directory / tag / COMPLETE).read_bytes()).hexdigest()

    def _problem(self, tag: str, digest: str) -> str:
        """Why this rank cannot load `tag` from its own view ("" when it can)."""
        tag_dir = self.directory / tag
        if not (tag_dir / COMPLETE).is_file():
            return f"{tag_dir / COMPLETE} does not exist"
        if self._digest(tag) != digest:
            return f"{tag_dir / COMPLETE} differs from rank 0's"
        wanted = {f"keel_rng_rank{self.topology.rank}.pt": None, **self.read_manifest(tag).get("files", {})}
        for name, size in wanted.items():
            path = tag_dir / name
            if not path.is_file():
                return f"{path} is missing"
            if size is not None and path.stat().st_size != size:
                return f"{path} has {path.stat().st_size} bytes, the manifest says {size}"
        return ""

    # -- save -----------------------------------------------------------------------------------------------
    def save(self, engine, state: TrainState, guards: dict[str, Any] | None = None,
             before_commit: Callable[[], None] | None = None) -> str:
        """Every rank writes its files, then rank 0 the manifest and `latest`. `before_commit` runs on each rank
        after its own files are written (fault injection: a rank that stalls mid-save)."""
        tag = tag_for(state.step)
        tag_dir = self.begin(tag)
        rank = self.topology.rank
        engine.save_checkpoint(str(self.directory), tag=tag, client_state=self.client_state(state),
                               save_latest=False)
        tag_dir.mkdir(parents=True, exist_ok=True)
        rng_path = tag_dir / f"keel_rng_rank{rank}.pt"
        tmp = rng_path.with_name(f".{rng_path.name}.tmp")
        torch.save(rng_state.capture(engine.module), tmp)
        os.replace(tmp, rng_path)
        if before_commit is not None:
            before_commit()
        comm.barrier(self.control)  # every rank has written its DeepSpeed shards and RNG file
        if rank == 0:
            files = {p.name: (p.stat().st_size, None) for p in sorted(tag_dir.iterdir())
                     if p.is_file() and p.name != COMPLETE and not p.name.startswith(".")}
            self.commit(tag, state, files, guards, engine.zero_optimization_stage())
        comm.barrier(self.control)
        return tag

    def begin(self, tag: str) -> Path:
        """Every rank, before writing `tag`: rank 0 marks it incomplete (a re-saved step is not loadable until
        it is whole again), and nobody writes before that."""
        if self.topology.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / tag / COMPLETE).unlink(missing_ok=True)
        comm.barrier(self.control)
        return self.directory / tag

    def client_state(self, state: TrainState) -> dict[str, Any]:
        return {"keel": asdict(state), "topology": self.topology.stamp()}

    def commit(self, tag: str, state: TrainState, files: dict[str, tuple[int, str | None]],
               guards: dict[str, Any] | None = None, zero_stage: int = 0) -> None:
        """Rank 0, once every rank's files of `tag` are in place: the manifest (`files`: name → (size, sha256 or
        None) over all ranks), then `latest`, then pruning — what makes a written checkpoint the one to load, for a
        synchronous and an asynchronous save alike."""
        topology = {**self.topology.stamp(), "zero_stage": zero_stage}
        names = sorted(files)
        manifest = {"tag": tag, **asdict(state), "topology": topology, "guards": guards or {},
                    "files": {n: files[n][0] for n in names}}
        if any(files[n][1] for n in names):
            manifest["sha256"] = {n: files[n][1] for n in names if files[n][1]}
        atomic_write_text(self.directory / tag / COMPLETE, json.dumps(manifest) + "\n")
        atomic_write_text(self.directory / LATEST, tag)
        self._prune(keep=tag)

    def _prune(self, keep: str) -> None:
        tags = [t for t in self.complete_tags() if t != keep]
        for tag in tags[: max(0, len(tags) - (self.keep_last - 1))]:
            shutil.rmtree(self.directory / tag, ignore_errors=True)

    # -- resharding ---------------------------------------------------------------------------------------------
    def needs_universal(self, tag: str, zero_stage: int) -> bool:
        """True when `tag` was written on a layout this run cannot load directly: another tp/pp split, or
        another data-parallel size while ZeRO partitions the optimizer state."""
        saved, now = self.read_manifest(tag)["topology"], self.topology.stamp()
        if (saved["tp"], saved["pp"]) != (now["tp"], now["pp"]):
            return True
        # ZeRO partitions over data × Ulysses-sequence parallel ranks
        partitions = saved["dp"] * saved.get("sp", 1), now["dp"] * now["sp"]
        return partitions[0] != partitions[1] and max(zero_stage, saved.get("zero_stage", zero_stage)) > 0

    def convert_universal(self, tag: str) -> None:
        """Rank 0: DeepSpeed's `ds_to_universal` into `<tag>/universal` (written aside, then renamed in)."""
        target = self.directory / tag / UNIVERSAL
        if target.is_dir():
            return
        tmp = self.directory / tag / f".{UNIVERSAL}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               str(self.directory / tag), "--output_folder", str(tmp), "--inject_missing_state",
               "--num_extract_workers", "1", "--num_merge_workers", "1"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ds_to_universal failed for {tag}:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)

    # -- load -----------------------------------------------------------------------------------------------
    def load(self, engine, tag: str, seed: int) -> TrainState:
        """Restore engine, scheduler and RNG from `tag`; returns the saved position. A checkpoint from another
        layout is read from its universal conversion (`convert_universal` must have run)."""
        manifest = self.read_manifest(tag)
        saved, now = manifest["topology"], self.topology.stamp()
        universal = engine.load_universal_checkpoint()
        load_path, _ = engine.load_checkpoint(
            str(self.directory), tag=f"{tag}/{UNIVERSAL}" if universal else tag, load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {self.directory / tag}")
        state = TrainState(**{k: manifest[k] for k in asdict(TrainState()) if k in manifest})
        rng_path = self.directory / tag / f"keel_rng_rank{self.topology.rank}.pt"
        same_layout = {k: saved[k] for k in now} == now
        if rng_path.is_file() and same_layout:
            missing = rng_state.restore(torch.load(rng_path, weights_only=False), engine.module)
            if missing and self.topology.rank == 0:
                log.warning("checkpoint %s predates saving the %s random stream(s): they restart from their seeds, "
                            "so this resume is not bitwise the uninterrupted run", tag, " and ".join(missing))
        else:  # a rank that did not exist when the checkpoint was written: derive a fresh, reproducible stream
            seed_everything(seed + 1000003 * state.step + self.topology.rank)
        return state


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
