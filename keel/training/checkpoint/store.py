"""Checkpoints: DeepSpeed's files plus Keel's client state, made "latest" only once every rank has written.

Layout of `<run_dir>/checkpoints/`:
    step00000100/            DeepSpeed's model/optimizer files for that step (its own format)
        keel_rng_rank<R>.pt  each rank's RNG streams (keel/training/checkpoint/rng_state.py)
        keel_complete.json   written by rank 0 once every rank's files are written: the checkpoint is whole;
                             lists every file with its size and chunk sha256s (hashed by the rank that
                             wrote it)
    step00000050.corrupt/    a checkpoint that failed verification: set aside, never deleted nor loaded
    latest                   DeepSpeed's pointer file, replaced atomically after keel_complete.json exists

A save is: every rank writes its files (keel/training/checkpoint/writes.py: hashed as they close, a failed write
kept on the rank), then `finish_save` — every rank's (error, file hashes) gathered to rank 0 — and, when no rank
failed, `commit` on rank 0 (manifest, `latest`, pruning). A failed save is discarded by every rank together: its
directory removed, nothing committed or pruned, `latest` untouched. A crash mid-save leaves a directory without
`keel_complete.json`; it is never loaded and is overwritten when that step is saved again.

Which checkpoint to load is chosen once: rank 0 picks the tag and broadcasts it with a digest of its manifest;
every rank checks that its own view holds that manifest and verifies a byte-balanced share of the files against
it (keel/training/checkpoint/verify.py); the verdicts meet on rank 0, which broadcasts the outcome. A tag this
process verified and has not written since is not verified again (a rollback to it). A rank whose view lacks the
manifest makes every rank stop together (`CheckpointDisagreement`, exit code 6) — a stale view of a shared
filesystem must not load another step's state. A file that does not match (cut short, bytes flipped, missing) is
corruption: recorded (`checkpoint_corrupt` in anomalies.jsonl), the directory set aside as `stepN.corrupt`,
`latest` repointed, and the next older candidate agreed the same way. When every candidate was corrupt the run
stops (`NoIntactCheckpoint`, exit 6) rather than start over from step 0 next to the set-aside checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from keel.parallel import comm
from keel.parallel.random import seed_everything
from keel.parallel.topology import STAMP_DEFAULTS, Topology
from keel.run_dir import (
    COMPLETE,
    LATEST,
    TAG,
    UNIVERSAL,
    ExitCode,
    step_of,
    tag_for,
    write_atomic,
)
from keel.training.checkpoint import rng_state, verify
from keel.training.checkpoint.moe_reshard import MOE_UNIVERSAL, moe_universal_tag
from keel.training.checkpoint.writes import WrittenFiles, failure_text

if TYPE_CHECKING:
    from keel.run_dir import AnomalyLog


log = logging.getLogger("keel")


class CheckpointDisagreement(RuntimeError):
    """Some rank does not see the checkpoint rank 0 chose, whole; every rank raises it with the same message."""

    exit_code = ExitCode.CHECKPOINT
    anomaly = "checkpoint_disagreement"


class NoIntactCheckpoint(CheckpointDisagreement):
    """Every checkpoint rank 0 could choose was corrupt and is set aside: stop rather than restart from step 0."""

    anomaly = "no_intact_checkpoint"


@dataclass
class SaveOutcome:
    """A save every rank agreed on: committed, or discarded with the first rank's error."""

    tag: str
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class TrainState:
    """Where the run is: optimizer steps taken and global samples consumed (the data position)."""

    step: int = 0
    consumed_samples: int = 0
    lr_scale: float = 1.0  # halved by each spike rollback
    rollbacks: int = 0
    skipped_steps: int = 0


class Checkpointer:
    def __init__(
        self,
        directory: Path,
        keep_last: int,
        topology: Topology,
        anomalies: AnomalyLog | None = None,
    ):
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.topology = topology
        self.control = topology.control("world")
        self.anomalies = anomalies
        self._resume: tuple[str | None] | None = None  # `agreed_resume`'s answer, once agreed
        # tags every rank verified in this process, by manifest digest (dropped when this process writes the tag)
        self._verified: dict[str, str] = {}
        self._last_committed: str | None = (
            None  # rank 0: the newest checkpoint this process committed
        )

    # -- discovery ------------------------------------------------------------------------------------------
    def tag_at_or_before(self, step: int) -> str | None:
        """The newest complete checkpoint written at or before `step` (the last healthy one for a rollback)."""
        tags = [t for t in self.complete_tags() if step_of(t) <= step]
        return tags[-1] if tags else None

    def complete_tags(self) -> list[str]:
        """Checkpoints with a completion marker, oldest first (set-aside `.corrupt` ones are not checkpoints)."""
        if not self.directory.is_dir():
            return []
        return sorted(
            p.name
            for p in self.directory.iterdir()
            if TAG.fullmatch(p.name) and (p / COMPLETE).is_file()
        )

    def latest_tag(self) -> str | None:
        """The tag `latest` names if it is complete, else the newest complete one (never a half-written one)."""
        pointer = self.directory / LATEST
        if pointer.is_file():
            tag = pointer.read_text().strip()
            if TAG.fullmatch(tag) and (self.directory / tag / COMPLETE).is_file():
                return tag
        tags = self.complete_tags()
        return tags[-1] if tags else None

    def read_manifest(self, tag: str) -> dict[str, Any]:
        return json.loads((self.directory / tag / COMPLETE).read_text())

    # -- the one choice every rank loads ------------------------------------------------------------------
    def agreed_latest(self) -> str | None:
        """`latest_tag()` as rank 0 sees it, verified on every rank (collective over the world)."""
        return self._agreed(self.latest_tag)

    def agreed_resume(self) -> str | None:
        """The checkpoint this run resumes from: `agreed_latest()`, agreed (and read) once per run although two
        places need it — keel/training/entry.py before the engine exists (to reshard), then the trainer."""
        if self._resume is None:
            self._resume = (self.agreed_latest(),)
        return self._resume[0]

    def agreed_at_or_before(self, step: int) -> str | None:
        """`tag_at_or_before(step)` as rank 0 sees it, verified on every rank (collective over the world)."""
        return self._agreed(lambda: self.tag_at_or_before(step))

    def _agreed(self, choose: Callable[[], str | None]) -> str | None:
        """Rank 0's choice once every rank verified it; a corrupt one is set aside and rank 0 chooses again.
        None: nothing to load. Raises CheckpointDisagreement (a rank's view differs) or NoIntactCheckpoint (every
        candidate was corrupt) on every rank alike."""
        set_aside: list[str] = []
        while True:
            tag = choose() if self.topology.rank == 0 else None
            offer = None
            if tag:
                digest = self._digest(tag)
                # verified here before, unchanged since: every rank skips it together (rank 0's word)
                offer = {
                    "tag": tag,
                    "digest": digest,
                    "verified": self._verified.get(tag) == digest,
                }
            offer = comm.broadcast_object(offer, self.control)
            if offer is None:
                if set_aside:
                    raise NoIntactCheckpoint(
                        f"every checkpoint in {self.directory} is corrupt ({', '.join(set_aside)}"
                        " set aside as <tag>.corrupt, see anomalies.jsonl): nothing to resume "
                        "from; restore a checkpoint or start a new run directory"
                    )
                return None
            tag = offer["tag"]
            if offer["verified"]:
                return tag
            corrupt = self._verdicts(tag, offer["digest"])
            if not corrupt:
                self._verified[tag] = offer["digest"]
                return tag
            self._set_aside(tag, corrupt)
            set_aside.append(tag)

    def _digest(self, tag: str) -> str:
        return hashlib.sha256((self.directory / tag / COMPLETE).read_bytes()).hexdigest()

    def _verdicts(self, tag: str, digest: str) -> list[tuple[str, str]]:
        """Every rank's verdict on `tag`, gathered to rank 0, which broadcasts the outcome: the (file, reason)
        pairs found corrupt, or CheckpointDisagreement (raised on every rank) when some rank's view lacks rank
        0's manifest. A rank other than 0 receives the outcome only, not every rank's verdict."""
        verdicts = comm.gather_object(self._verdict(tag, digest), self.control)
        outcome = None
        if verdicts is not None:
            bad = [
                f"rank {r}: {view}" for r, (view, _) in zip(self.control.ranks, verdicts) if view
            ]
            corrupt = sorted({(name, reason) for _, found in verdicts for name, reason in found})
            outcome = (bad[0], len(bad)) if bad else corrupt
        outcome = comm.broadcast_object(outcome, self.control)
        if isinstance(outcome, tuple):
            first, count = outcome
            more = f" (and {count - 1} more rank(s))" if count > 1 else ""
            raise CheckpointDisagreement(
                f"checkpoint {tag} chosen by rank 0 is not whole on every rank — {first}{more}; every "
                "rank must see the same checkpoint directory (a stale or different shared-filesystem view?)"
            )
        return [tuple(pair) for pair in outcome]

    def _verdict(self, tag: str, digest: str) -> tuple[str, list[tuple[str, str]]]:
        """(why this rank's view is not rank 0's, or ""; the files of this rank's share that do not match)."""
        manifest = self.directory / tag / COMPLETE
        if not manifest.is_file():
            return f"{manifest} does not exist", []
        if self._digest(tag) != digest:
            return f"{manifest} differs from rank 0's", []
        try:
            files = verify.read_manifest_files(manifest)
        except ValueError as err:  # every rank read the same bytes: all of them say so
            return "", [(COMPLETE, f"the manifest {err}")]
        share = verify.shares(verify.pieces(files), self.control.size)
        return "", verify.verify(manifest.parent, files, share[self.control.rank])

    def _set_aside(self, tag: str, corrupt: list[tuple[str, str]]) -> None:
        """Record the corrupt checkpoint, rename it `<tag>.corrupt` and repoint `latest` (rank 0 renames)."""
        step = step_of(tag)
        if self.anomalies is not None:
            self.anomalies.record(
                "checkpoint_corrupt",
                step,
                checkpoint=tag,
                file=corrupt[0][0],
                reason=corrupt[0][1],
                files=[{"file": f, "reason": r} for f, r in corrupt],
            )
        if self.topology.rank != 0:
            return
        moved = verify.set_aside(self.directory, tag)
        pointer = self.directory / LATEST
        if pointer.is_file() and pointer.read_text().strip() == tag:
            tags = self.complete_tags()
            if tags:
                write_atomic(pointer, tags[-1])
            else:
                pointer.unlink()
        more = f" (and {len(corrupt) - 1} more file(s))" if len(corrupt) > 1 else ""
        log.error(
            "checkpoint %s is corrupt: %s: %s%s — set aside as %s",
            tag,
            corrupt[0][0],
            corrupt[0][1],
            more,
            moved.name,
        )

    # -- save -----------------------------------------------------------------------------------------------
    def save(
        self,
        engine,
        state: TrainState,
        guards: dict[str, Any] | None = None,
        before_commit: Callable[[], None] | None = None,
        disk_room: int | None = None,
    ) -> SaveOutcome:
        """Every rank writes its files, then `finish_save`. Fault injection: `before_commit` runs on each rank after
        its own files are written (a rank that stalls mid-save); `disk_room` bytes fill this rank's disk."""
        tag = tag_for(state.step)
        rank = self.topology.rank
        written = WrittenFiles(rank, disk_room)
        tag_dir = self.begin(tag, written.guard)
        with written.seam(engine):
            engine.save_checkpoint(
                str(self.directory),
                tag=tag,
                client_state=self.client_state(state),
                save_latest=False,
            )
        written.guard(lambda: tag_dir.mkdir(parents=True, exist_ok=True), tag_dir)
        written.write(
            tag_dir / f"keel_rng_rank{rank}.pt",
            lambda to: torch.save(rng_state.capture(engine.module), to),
        )
        if before_commit is not None:
            before_commit()
        error, files = written.result()
        return self.finish_save(tag, state, error, files, guards, engine.zero_optimization_stage())

    def begin(self, tag: str, guard: Callable[[Callable[[], Any], Path], None]) -> Path:
        """Every rank, before writing `tag`: rank 0 marks it incomplete (a re-saved step is not loadable until
        it is whole again), and nobody writes before that. Rank 0's changes go through `guard` (a failure is the
        save's, keel/training/checkpoint/writes.py)."""
        self._verified.pop(tag, None)  # written again: verified again when loaded
        if self.topology.rank == 0:
            self._notice_vanished(tag)
            guard(lambda: self.directory.mkdir(parents=True, exist_ok=True), self.directory)
            complete = self.directory / tag / COMPLETE
            guard(lambda: complete.unlink(missing_ok=True), complete)
        comm.barrier(self.control)
        return self.directory / tag

    def _notice_vanished(self, tag: str) -> None:
        """Rank 0: say so when the checkpoint this run last committed is gone (its directory deleted under the
        run): this save recreates the directory, and until it is committed there is nothing to resume from."""
        last, self._last_committed = self._last_committed, None
        if last is None or (self.directory / last / COMPLETE).is_file():
            self._last_committed = last
            return
        if self.anomalies is not None:
            self.anomalies.record(
                "checkpoints_vanished", step_of(tag), checkpoint=last, directory=str(self.directory)
            )
        log.warning(
            "checkpoint %s, saved by this run, is gone from %s (deleted during the run?); saving %s recreates "
            "the directory, and until it is complete there is no checkpoint to resume from",
            last,
            self.directory,
            tag,
        )

    def client_state(self, state: TrainState) -> dict[str, Any]:
        """What DeepSpeed stores beside the engine state: Keel's train state and the layout that wrote it."""
        return {"keel": asdict(state), "topology": self.topology.stamp()}

    def finish_save(
        self,
        tag: str,
        state: TrainState,
        error: str,
        files: dict[str, tuple[int, list[str]]],
        guards: dict[str, Any] | None = None,
        zero_stage: int = 0,
    ) -> SaveOutcome:
        """Every rank, once its files for `tag` are written (`error`: its first failure, or ""; `files`: name →
        (size, chunk sha256s) of what it wrote): these verdicts gathered to rank 0, which commits (the manifest
        from the gathered hashes, `latest`, pruning) or discards the save, and one broadcast tells every rank
        which."""
        # to rank 0 only, which commits: every rank's file list, O(world) there and nowhere else
        verdicts = comm.gather_object((error, files), self.control)
        errors = []
        if verdicts is not None:
            errors = [f"rank {r}: {e}" for r, (e, _) in zip(self.control.ranks, verdicts) if e]
        if self.topology.rank == 0 and not errors:
            try:
                self.commit(
                    tag,
                    state,
                    {name: entry for _, f in verdicts for name, entry in f.items()},
                    guards,
                    zero_stage,
                )
            # the manifest or `latest` could not be written: the save failed after all
            except OSError as exc:
                errors = [f"rank 0: committing {tag}: {failure_text(exc)}"]
        # half-written: all still in memory, and a full disk needs the space
        if self.topology.rank == 0 and errors:
            shutil.rmtree(self.directory / tag, ignore_errors=True)
        # rank 0's commit, and the end of the save everywhere
        errors = comm.broadcast_object(errors, self.control)
        if errors:
            more = f" (and {len(errors) - 1} more rank(s))" if len(errors) > 1 else ""
            return SaveOutcome(tag, errors[0] + more)
        return SaveOutcome(tag)

    def commit(
        self,
        tag: str,
        state: TrainState,
        files: dict[str, tuple[int, list[str]]],
        guards: dict[str, Any] | None = None,
        zero_stage: int = 0,
    ) -> None:
        """Rank 0, after an agreed verdict that every rank's files are written: the manifest (every file's size
        and sha256), then `latest`, then pruning down to `keep_last`."""
        tag_dir = self.directory / tag
        # a file in the tag that no hashed write made (a `guard`ed change; none in DeepSpeed 0.19): described here
        for path in sorted(tag_dir.iterdir()):
            if (
                path.is_file()
                and path.name != COMPLETE
                and not path.name.startswith(".")
                and path.name not in files
            ):
                files[path.name] = verify.describe(path)
        topology = {**self.topology.stamp(), "zero_stage": zero_stage}
        names = sorted(files)
        manifest = {
            "tag": tag,
            **asdict(state),
            "topology": topology,
            "guards": guards or {},
            "files": {n: files[n][0] for n in names},
            "chunk_bytes": verify.CHUNK_HASH_BYTES,
            "sha256_chunks": {n: files[n][1] for n in names},
        }
        write_atomic(tag_dir / COMPLETE, json.dumps(manifest) + "\n")
        write_atomic(self.directory / LATEST, tag)
        self._last_committed = tag
        self._prune(keep=tag)

    def _prune(self, keep: str) -> None:
        tags = [t for t in self.complete_tags() if t != keep]
        for tag in tags[: max(0, len(tags) - (self.keep_last - 1))]:
            shutil.rmtree(self.directory / tag, ignore_errors=True)

    # -- resharding ---------------------------------------------------------------------------------------------
    def needs_universal(self, tag: str, zero_stage: int) -> bool:
        """True when `tag` was written on a layout this run cannot load directly: another tp/pp split or pipeline
        schedule, or another data-parallel size while ZeRO partitions the optimizer state."""
        saved, now = self.read_manifest(tag)["topology"], self.topology.stamp()
        if (saved["tp"], saved["pp"]) != (now["tp"], now["pp"]):
            return True
        schedule = (
            "pipeline_schedule",
            "virtual_stages",
        )  # another set of stages per rank (DualPipeV, interleaved)
        if any(saved.get(key, STAMP_DEFAULTS[key]) != now[key] for key in schedule):
            return True
        # ZeRO partitions over data × sequence (Ulysses sp, context cp) parallel ranks
        partitions = (
            saved["dp"] * saved.get("sp", 1) * saved.get("cp", 1),
            now["dp"] * now["sp"] * now["cp"],
        )
        # experts move between ranks (keel/training/checkpoint/moe_reshard.py)
        if saved.get("ep", 1) != now["ep"]:
            return True
        return (
            partitions[0] != partitions[1]
            and max(zero_stage, saved.get("zero_stage", zero_stage)) > 0
        )

    def _universal_tag(self, tag: str) -> str:
        """Where this rank reads a converted checkpoint: DeepSpeed's universal folder, or for an MoE model the
        folder Keel's converter wrote for this rank's (tp, ep) position."""
        ep = self.topology.size("ep")
        if (self.directory / tag / MOE_UNIVERSAL / f"ep{ep}").is_dir():
            return moe_universal_tag(
                tag, ep, self.topology.rank_in("tp"), self.topology.rank_in("ep")
            )
        return f"{tag}/{UNIVERSAL}"

    # -- load -----------------------------------------------------------------------------------------------
    def load(self, engine, tag: str, seed: int) -> TrainState:
        """Restore engine, scheduler and RNG from `tag`; returns the saved position. A checkpoint from another
        layout is read from its universal conversion (reshard.py's, which must have run)."""
        manifest = self.read_manifest(tag)
        saved, now = manifest["topology"], self.topology.stamp()
        universal = engine.load_universal_checkpoint()
        load_path, _ = engine.load_checkpoint(
            str(self.directory),
            tag=self._universal_tag(tag) if universal else tag,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {self.directory / tag}")
        state = TrainState(**{k: manifest[k] for k in asdict(TrainState()) if k in manifest})
        rng_path = self.directory / tag / f"keel_rng_rank{self.topology.rank}.pt"
        same_layout = {k: saved.get(k, STAMP_DEFAULTS.get(k)) for k in now} == now
        if rng_path.is_file() and same_layout:
            missing = rng_state.restore(torch.load(rng_path, weights_only=False), engine.module)
            if missing and self.topology.rank == 0:
                log.warning(
                    "checkpoint %s predates saving the %s random stream(s): they restart from their seeds, "
                    "so this resume is not bitwise the uninterrupted run",
                    tag,
                    " and ".join(missing),
                )
        else:  # a rank that did not exist when the checkpoint was written: derive a fresh, reproducible stream
            seed_everything(seed + 1000003 * state.step + self.topology.rank)
        return state
