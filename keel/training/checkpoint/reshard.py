"""Resuming on another layout: the latest checkpoint converted to a universal one, the work spread over ranks.

A run that resumes on another tp/pp split, pipeline schedule, expert-parallel size or (under ZeRO) data-parallel
size loads a universal checkpoint: DeepSpeed's `ds_to_universal` (dense models), or Keel's own converter for MoE
(moe_reshard.py). Both do the same two things: extract every optimizer file's fragments, then merge each
parameter's. Here:

- The work is spread over up to `MAX_CONVERTERS` ranks, one per node before a second on any node (DeepSpeed's
  converter first reads every model-states file to learn the layout, so each converter pays that once: past a few
  dozen converters it costs more than it saves). Each takes every P-th file, then every P-th parameter; each
  phase ends with the converters' results gathered, which is also its barrier (the merge reads every converter's
  fragments). The first rank then finishes alone (the files every rank reads) and renames the result in.
- The other ranks wait on the store, not in a collective: rank 0 beats every `HEARTBEAT_S` while it converts, so
  a conversion may take as long as it takes (no process-group timeout applies), and a rank 0 that died is seen
  within `STALE_S` (one line, exit 1) instead of after the 30-minute collective timeout.
- The watchdog is armed (keel/training/observe/watchdog.py): each converted file or parameter, and on a waiting
  rank each beat of rank 0, restarts its clock; no progress for `stability.watchdog_save_timeout` is a hang,
  with its stacks dumped and ExitCode.HANG.

The converted checkpoint is written aside (`.universal.partial`), renamed in whole, and kept: a later resume of
the same layout, or a restart, reuses it.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from keel.adapters.deepspeed_internals import convert_to_universal
from keel.adapters.torch_internals import default_store
from keel.engine.ds_config import zero_stage
from keel.parallel import comm
from keel.parallel.topology import STAMP_DEFAULTS, Topology
from keel.run_dir import UNIVERSAL, AnomalyLog
from keel.training.checkpoint.moe_reshard import (
    MOE_UNIVERSAL,
    check_moe_reshard,
    convert_moe_universal,
)
from keel.training.checkpoint.store import Checkpointer
from keel.training.observe.watchdog import Watchdog

MAX_CONVERTERS = 32
HEARTBEAT_S = 10.0
STALE_S = 120.0  # no beat from rank 0 for this long: it is gone

log = logging.getLogger("keel")


def reshard_if_needed(
    cfg, ds_raw: dict, topology: Topology, checkpointer: Checkpointer, run_dir: Path
) -> dict:
    """Resuming on another layout (a node lost, a different world size): the latest checkpoint is converted to a
    universal one and every rank loads that; the global batch stays fixed because gradient accumulation is derived
    from the new data-parallel size. The checkpoint is verified here, before converting (the trainer's resume then
    finds it verified). Returns the DeepSpeed config, set to load a universal checkpoint where one is needed."""
    # rank 0 chooses, every rank verifies
    tag = checkpointer.agreed_resume() if cfg.checkpoint.resume else None
    if tag is None or not checkpointer.needs_universal(tag, zero_stage(ds_raw)):
        return ds_raw
    manifest = checkpointer.read_manifest(tag)
    saved = manifest["topology"]
    # DeepSpeed's converter cannot place experts: Keel's own (moe_reshard.py)
    if cfg.model.moe_experts:
        check_moe_reshard(saved, topology.stamp(), zero_stage(ds_raw), cfg.model.moe_experts)
    if topology.rank == 0:
        # the schedule matters (and is shown) only then
        pipelined = max(saved["pp"], topology.shape.pp) > 1
        shown = ("world_size", "dp", "ep", "tp", "pp") + (
            ("pipeline_schedule", "virtual_stages") if pipelined else ()
        )
        log.warning(
            "checkpoint %s was written at %s; this run is %s: converting to a universal checkpoint",
            tag,
            {k: saved.get(k, STAMP_DEFAULTS.get(k, 1)) for k in shown},
            topology.describe(),
        )
    conversion = Conversion(checkpointer, tag, saved, cfg.model.moe_experts)
    stability = cfg.stability
    # the save's deadline (checkpoint-sized work), where the watchdog is on at all
    timeout = stability.watchdog_save_timeout if stability.watchdog_timeout > 0 else 0.0
    watchdog = Watchdog(run_dir, topology.rank, timeout, AnomalyLog(run_dir, topology.rank))
    with watchdog:
        watchdog.beat(manifest["step"])
        with watchdog.phase("universal checkpoint conversion", timeout):
            seconds = conversion.run(topology, watchdog.progress)
    if topology.rank == 0 and seconds is not None:
        log.info("converted %s in %.1f s over %d rank(s)", tag, seconds, len(conversion.converters))
    comm.barrier(topology.control("world"))
    return {**ds_raw, "checkpoint": {**ds_raw.get("checkpoint", {}), "load_universal": True}}


def converters(world_size: int, local_world_size: int, most: int = MAX_CONVERTERS) -> list[int]:
    """The ranks that convert: each node's first rank, then each node's second, …, at most `most` (ranks are
    numbered node by node, `local_world_size` to a node, as torchrun, SLURM and the deepspeed launcher number
    them)."""
    per_node = max(1, min(local_world_size, world_size))
    order = sorted(range(world_size), key=lambda r: (r % per_node, r // per_node))
    return sorted(order[: max(1, min(most, world_size))])


class Share:
    """Work items spread over the converters: each does every P-th item of the items in one order (their reprs
    sorted: a converter may list them in another order, as DeepSpeed's come out of sets, and each process salts
    its string hashes differently), reporting `progress` after each; the phase ends with every converter's
    results gathered (in no order a caller relies on)."""

    def __init__(self, group: comm.Group, progress: Callable[[], None]):
        self.group = group
        self.progress = progress

    def __call__(self, do_work: Callable[[Any], Any], items: list) -> list:
        mine = []
        for item in sorted(items, key=repr)[self.group.rank :: self.group.size]:
            mine.append(do_work(item))
            self.progress()
        return [result for part in comm.all_gather_object(mine, self.group) for result in part]


class Conversion:
    """One checkpoint's conversion for this run's layout, run on every rank (`run`)."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        tag: str,
        saved: dict[str, Any],
        num_experts: int,
        most: int = MAX_CONVERTERS,
    ):
        self.checkpointer = checkpointer
        self.most = most
        self.tag = tag
        self.saved = saved
        self.num_experts = num_experts
        self.converters: list[int] = []

    def target(self, topology: Topology) -> Path:
        tag_dir = self.checkpointer.directory / self.tag
        if self.num_experts:
            return tag_dir / MOE_UNIVERSAL / f"ep{topology.size('ep')}"
        return tag_dir / UNIVERSAL

    def run(self, topology: Topology, progress: Callable[[], None]) -> float | None:
        """Convert (a converter), or wait for rank 0 to have converted (every other rank). Returns the
        conversion's seconds on rank 0, None where it was already there."""
        target = self.target(topology)
        if target.is_dir():  # converted before: by an earlier attempt, kept
            return None
        world = topology.shape.world_size
        self.converters = converters(world, _local_world_size(world), self.most)
        key = f"keel/universal/{self.tag}/{target.name}"
        store = default_store()
        if topology.rank not in self.converters:
            wait_for_rank0(store, key, progress)
            return None
        group = topology.subgroup("converters", self.converters, comm.CONTROL)
        start = time.monotonic()
        beat = Heartbeat(store, key) if topology.rank == 0 else None
        error = ""
        try:
            self._convert(target, group, Share(group, progress))
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise
        finally:
            if beat is not None:
                beat.stop(error)
        if beat is None:  # the rest is rank 0's: wait for it here too, not in a collective
            wait_for_rank0(store, key, progress)
        return time.monotonic() - start

    def _convert(self, target: Path, group: comm.Group, share: Share) -> None:
        partial = target.with_name(f".{target.name}.partial")
        lead = group.rank == 0
        if lead:  # an earlier attempt's leftovers, before any converter writes
            shutil.rmtree(partial, ignore_errors=True)
            partial.parent.mkdir(parents=True, exist_ok=True)
        comm.barrier(group)
        if self.num_experts:
            convert_moe_universal(
                self.checkpointer.directory / self.tag,
                self.saved,
                self.checkpointer.topology.stamp(),
                self.num_experts,
                partial,
                share,
                lead,
            )
        else:
            printed = convert_to_universal(
                str(self.checkpointer.directory / self.tag), str(partial), share, lead
            )
            log.debug("ds_to_universal said:\n%s", printed)
        if lead:
            partial.replace(target)


def _local_world_size(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


class Heartbeat:
    """Rank 0's beat in the store while it converts, and its verdict when done ("" for success)."""

    def __init__(self, store: dist.Store, key: str, interval_s: float = HEARTBEAT_S):
        self.store = store
        self.key = key
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="keel-reshard-beat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            self.store.set(f"{self.key}/beat", str(count))
            self._stop.wait(self.interval_s)

    def stop(self, error: str) -> None:
        self._stop.set()
        self._thread.join()
        self.store.set(f"{self.key}/done", error or "ok")


def wait_for_rank0(
    store: dist.Store,
    key: str,
    progress: Callable[[], None],
    interval_s: float = HEARTBEAT_S,
    stale_s: float = STALE_S,
) -> None:
    """Wait for rank 0's verdict; each new beat is progress. Raises if rank 0 failed or stopped beating."""
    last, last_seen = None, time.monotonic()
    while True:
        try:
            store.wait([f"{key}/done"], datetime.timedelta(seconds=interval_s))
            break
        except dist.DistStoreError:  # no verdict yet: is rank 0 still beating?
            beat = store.get(f"{key}/beat") if store.check([f"{key}/beat"]) else None
            if beat != last:
                last, last_seen = beat, time.monotonic()
                progress()
            elif time.monotonic() - last_seen > stale_s:
                raise RuntimeError(
                    f"rank 0 stopped beating {time.monotonic() - last_seen:.0f} s ago while converting "
                    f"the checkpoint to a universal one ({key}); see rank 0's log"
                ) from None
    verdict = store.get(f"{key}/done").decode()
    if verdict != "ok":
        raise RuntimeError(f"rank 0 could not convert the checkpoint ({key}): {verdict}")
