"""Checkpoints: DeepSpeed's files plus Keel's client state, made "latest" only once every rank has written.

Layout of `<run_dir>/checkpoints/`:
    step00000100/            DeepSpeed's model/optimizer files for that step (its own format)
        keel_rng_rank<R>.pt  each rank's RNG states (python, numpy, torch)
        keel_complete.json   written by rank 0 after a barrier: the checkpoint is whole
    latest                   DeepSpeed's pointer file, replaced atomically after keel_complete.json exists

A crash mid-save leaves a directory without `keel_complete.json`; it is never loaded and is overwritten when
that step is saved again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keel.parallel import comm
from keel.parallel.topology import Topology

COMPLETE = "keel_complete.json"
UNIVERSAL = "universal"
LATEST = "latest"


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


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


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

    # -- save -----------------------------------------------------------------------------------------------
    def save(self, engine, state: TrainState, guards: dict[str, Any] | None = None) -> str:
        tag = tag_for(state.step)
        tag_dir = self.directory / tag
        rank = self.topology.rank
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            (tag_dir / COMPLETE).unlink(missing_ok=True)  # re-saving a step: it is incomplete until we finish
        comm.barrier(self.control)
        client_state = {"keel": asdict(state), "topology": self.topology.stamp()}
        engine.save_checkpoint(str(self.directory), tag=tag, client_state=client_state, save_latest=False)
        tag_dir.mkdir(parents=True, exist_ok=True)
        rng_path = tag_dir / f"keel_rng_rank{rank}.pt"
        tmp = rng_path.with_name(f".{rng_path.name}.tmp")
        torch.save(rng_state(), tmp)
        os.replace(tmp, rng_path)
        comm.barrier(self.control)  # every rank has written its DeepSpeed shards and RNG file
        if rank == 0:
            topology = {**self.topology.stamp(), "zero_stage": engine.zero_optimization_stage()}
            manifest = {"tag": tag, **asdict(state), "topology": topology, "guards": guards or {}}
            atomic_write_text(tag_dir / COMPLETE, json.dumps(manifest) + "\n")
            atomic_write_text(self.directory / LATEST, tag)
            self._prune(keep=tag)
        comm.barrier(self.control)
        return tag

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
            set_rng_state(torch.load(rng_path, weights_only=False))
        else:  # a rank that did not exist when the checkpoint was written: derive a fresh, reproducible stream
            seed_everything(seed + 1000003 * state.step + self.topology.rank)
        return state


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
