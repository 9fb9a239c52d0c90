"""What the training loop does with checkpoints: resume, save, publish background saves, roll back.

One seam between the loop (keel/training/trainer.py) and everything a checkpoint involves — the agreed choice of
what to load (keel/training/checkpoint/store.py), a synchronous save or a background one (`checkpoint.async_save`,
keel/training/checkpoint/async_save.py), the corrupt-state gate that keeps non-finite state off disk
(keel/training/guards/state.py) and the `checkpoint.on_save_error` policy
(keel/training/checkpoint/save_failures.py) — so that every rank takes the same collectives in the same order
whichever of them applies.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from keel.config import RunConfig
from keel.engine.build import LRScale
from keel.engine.lr_schedule import refresh_lr
from keel.run_dir import AnomalyLog, ExitCode
from keel.training.checkpoint.async_save import AsyncCheckpointer
from keel.training.checkpoint.memory import MemoryCheckpoints
from keel.training.checkpoint.save_failures import after_failed_save
from keel.training.checkpoint.store import Checkpointer, SaveOutcome, TrainState
from keel.training.faults import FaultInjector
from keel.training.guards.base import Action, Decision
from keel.training.guards.stack import GuardStack
from keel.training.guards.state import CorruptStateGuard

log = logging.getLogger("keel")


class RunCheckpoints:
    """The run's checkpoints as the loop sees them. Every method is collective over the world."""

    def __init__(
        self,
        cfg: RunConfig,
        engine,
        checkpointer: Checkpointer,
        anomalies: AnomalyLog,
        guards: GuardStack,
        corrupt_state: CorruptStateGuard,
        faults: FaultInjector,
        lr_scale: LRScale,
        memory: MemoryCheckpoints | None = None,
    ):
        self.cfg, self.engine, self.checkpointer, self.anomalies = (
            cfg,
            engine,
            checkpointer,
            anomalies,
        )
        self.guards, self.corrupt_state, self.faults, self.lr_scale = (
            guards,
            corrupt_state,
            faults,
            lr_scale,
        )
        self.rank = checkpointer.topology.rank
        # checkpoint.memory_interval: snapshots in host memory and on a buddy (memory.py); agreed before the engine
        self.memory = memory
        # checkpoint.async_save: a host snapshot now, the files written in the background (async_checkpoint.py)
        self.saves = (
            AsyncCheckpointer(checkpointer, pin=torch.device(engine.device).type == "cuda")
            if cfg.checkpoint.async_save
            else None
        )

    def resume(self) -> TrainState:
        """The state to start from: the agreed latest checkpoint's (and the guards' and LR scale's), or a new one."""
        if not self.cfg.checkpoint.resume:
            return TrainState()
        restored = self.memory.restored if self.memory is not None else None
        if restored is not None:
            return self._resume_from_memory()
        # rank 0 chooses, every rank verifies (once per run)
        tag = self.checkpointer.agreed_resume()
        if tag is None:
            return TrainState()
        state = self.checkpointer.load(self.engine, tag, self.cfg.train.seed)
        if self.memory is not None:  # snapshots past it belong to a path this run no longer takes
            self.memory.discard_after(state.step)
        self.guards.load_state_dict(self.checkpointer.read_manifest(tag).get("guards", {}))
        self.lr_scale.value = state.lr_scale
        refresh_lr(self.engine.lr_scheduler)
        # the run's history: where a restart, requeue or continuation picked up (`keel report` marks it)
        self.anomalies.record(
            "resume", state.step, checkpoint=tag, consumed_samples=state.consumed_samples
        )
        if self.rank == 0:
            log.info(
                "resumed from %s: step %d, %d samples consumed",
                tag,
                state.step,
                state.consumed_samples,
            )
        return state

    def _resume_from_memory(self) -> TrainState:
        restored = self.memory.restored
        state, guards = self.memory.load(self.engine, restored)
        self.guards.load_state_dict(guards)
        self.lr_scale.value = state.lr_scale
        refresh_lr(self.engine.lr_scheduler)
        self.anomalies.record(
            "resume",
            state.step,
            memory=True,
            consumed_samples=state.consumed_samples,
            from_node=restored.local,
            from_copy=restored.received,
            bytes_moved=restored.bytes_moved,
        )
        if self.rank == 0:
            log.info(
                "resumed from the in-memory snapshot of step %d in %.2f s (%d rank(s) from their node's memory, "
                "%d from a copy on another node, %.1f MiB moved): %d samples consumed",
                state.step,
                restored.seconds,
                restored.local,
                restored.received,
                restored.bytes_moved / 2**20,
                state.consumed_samples,
            )
        return state

    def snapshot(self, state: TrainState) -> float:
        """checkpoint.memory_interval: this step's in-memory snapshot when one is due (the seconds training waited
        for it); none of non-finite state (the corrupt-state gate, as for a save)."""
        if self.memory is None or not self.memory.due(state.step):
            return 0.0
        if not self.corrupt_state.allows_save(state.step):
            return 0.0
        return self.memory.snapshot(self.engine, state, self.guards.state_dict())

    def snapshot_state(self) -> int:
        """For the step's agreement: 0 this rank's newest in-memory snapshot is whole (or none is taken), 1 it
        failed, 2 it is in flight."""
        return 0 if self.memory is None else self.memory.state()

    def settle_snapshots(self) -> None:
        """The step's agreement found every rank's newest snapshot whole: the older ones may go."""
        if self.memory is not None:
            self.memory.settle()

    def finish(self, finished: bool) -> None:
        """The run's end: a finished run's snapshots go (memory held for nothing); a stopped one keeps them for
        its restart."""
        if self.memory is None:
            return
        if finished:
            self.memory.clear()
        else:
            self.memory.wait()

    def save(self, state: TrainState, ending: bool) -> tuple[float, Decision]:
        """Checkpoint `state` (`ending`: the run's last save, whose failure always stops it): (seconds the save
        kept training waiting, what the loop must do about it). With checkpoint.async_save only the snapshot is
        taken here; the files' verdict arrives through `background`."""
        started = time.perf_counter()
        saved = self._save(state)
        seconds = time.perf_counter() - started
        # corrupt state: a run that ends so stops; else it returns to a good checkpoint
        if saved is None:
            return seconds, self.corrupt_state.refused_save(state.step, ending)
        if not saved.ok:  # discarded on every rank (keel/training/checkpoint/save_failures.py)
            failed = after_failed_save(
                saved,
                self.cfg.checkpoint.on_save_error,
                ending,
                state.step,
                self.anomalies,
                self.rank,
                self.checkpointer.latest_tag(),
            )
            return seconds, Decision(
                Action.STOP, failed, ExitCode.SAVE_FAILED
            ) if failed else Decision()
        if self.rank == 0:
            log.info("step %d: checkpoint saved in %.2f s", state.step, seconds)
        return seconds, Decision()

    def _save(self, state: TrainState) -> SaveOutcome | None:
        """None: some rank's state is non-finite, nothing is written."""
        if not self.corrupt_state.allows_save(state.step):
            return None
        during_save = functools.partial(self.faults.during_save, state.step)
        if self.saves is not None:
            return SaveOutcome(
                self.saves.save(
                    self.engine, state, guards=self.guards.state_dict(), before_commit=during_save
                )
            )
        return self.checkpointer.save(
            self.engine,
            state,
            guards=self.guards.state_dict(),
            before_commit=during_save,
            disk_room=self.faults.disk_room(state.step),
        )

    def writing(self) -> tuple[str | None, bool]:
        """(the pending background save's tag, whether this rank still writes it); (None, False) without one."""
        return (None, False) if self.saves is None else self.saves.writing()

    def background(
        self, wait: bool = False, final: bool = False, written: str | None = None
    ) -> Decision:
        """Publish the background saves every rank has written (`written`: the tag the step's agreement found
        written on every rank; `wait`: the pending one first); a failed one was discarded on every rank and
        follows checkpoint.on_save_error like a synchronous one (`final`: the run's last save, whose failure
        always stops with ExitCode.SAVE_FAILED)."""
        outcomes = [] if self.saves is None else self.saves.poll(wait, written)
        for outcome in outcomes:
            if outcome.ok:
                continue
            reason = after_failed_save(
                outcome,
                self.cfg.checkpoint.on_save_error,
                final,
                outcome.step,
                self.anomalies,
                self.rank,
                self.checkpointer.latest_tag(),
            )
            if reason:
                return Decision(Action.STOP, reason, ExitCode.SAVE_FAILED)
        return Decision()

    def rollback(
        self,
        state: TrainState,
        rewind: Callable[[int], None],
        first_bad_step: int,
        reason: str,
        lr_factor: float,
        to: str | None = None,
        rewind_data: bool = False,
    ) -> TrainState:
        """Reload the last checkpoint written before `first_bad_step` (or `to`, already agreed), scale the LR, keep
        the data cursor (or, `rewind_data`, continue from the checkpoint's: its samples were innocent);
        `rewind(step)` truncates the run's logs to the restored step. A pending background save must have
        concluded (`background(wait=True)`): the choice of where to return counts it."""
        started = time.perf_counter()
        # rank 0 chooses, every rank verifies
        tag = to or self.checkpointer.agreed_at_or_before(first_bad_step - 1)
        if tag is None:
            self.anomalies.record(
                "rollback", state.step, done=False, reason=f"{reason}; no checkpoint to return to"
            )
            log.warning(
                "step %d: %s, but no checkpoint precedes step %d: continuing",
                state.step,
                reason,
                first_bad_step,
            )
            return state
        cursor, scale, rollbacks = (
            state.consumed_samples,
            state.lr_scale * lr_factor,
            state.rollbacks,
        )
        restored = self.checkpointer.load(self.engine, tag, self.cfg.train.seed)
        if self.memory is not None:  # the snapshots after it hold the path rolled back from
            self.memory.discard_after(restored.step)
        cursor = restored.consumed_samples if rewind_data else cursor
        restored.consumed_samples, restored.lr_scale, restored.rollbacks = (
            cursor,
            scale,
            rollbacks + 1,
        )
        self.lr_scale.value = scale
        refresh_lr(self.engine.lr_scheduler)
        rewind(restored.step)
        self.anomalies.record(
            "rollback",
            state.step,
            done=True,
            reason=reason,
            to_step=restored.step,
            checkpoint=tag,
            lr_scale=scale,
            data_cursor=cursor,
            seconds=round(time.perf_counter() - started, 4),
        )
        log.warning(
            "step %d: %s — rolled back to %s, LR × %.3g, data continues at sample %d",
            state.step,
            reason,
            tag,
            scale,
            cursor,
        )
        return restored
