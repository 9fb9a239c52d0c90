"""What every rank runs: init the process group, build topology, data, engine, and train.

Forked by Keel's local launcher (torchrun's API, keel/launcher/local.py: `rank_main`), started as `python -m
keel.training.entry RUN_DIR [RUN_DIR ...]` by torchrun, or run in place by `keel train` when an external launcher
(torchrun, deepspeed, srun) already set RANK and WORLD_SIZE.
Several run dirs train one after another in the same world (a sweep of short runs in one allocation pays the
process start, imports and rendezvous once); each keeps its own outcome in its run dir.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from keel.adapters.deepspeed_internals import forget_run_groups
from keel.data.blend_prepare import open_splits
from keel.engine.build import LRScale, build_engine, document_eos
from keel.engine.distributed import init_distributed, setup_logging
from keel.parallel import comm
from keel.parallel.process_groups import ProcessGroups
from keel.parallel.random import data_parallel_seed, seed_everything
from keel.parallel.topology import Topology
from keel.run_dir import AnomalyLog, ExitCode, RunDir, checkpoint_dir, read_run_dir, step_of
from keel.training.checkpoint.memory import MemoryCheckpoints
from keel.training.checkpoint.reshard import reshard_if_needed
from keel.training.checkpoint.store import CheckpointDisagreement, Checkpointer
from keel.training.observe import timeline
from keel.training.observe.summary import write_summary
from keel.training.observe.timeline import StartupClock, process_started
from keel.training.trainer import Trainer


def run_rank(run_dir: Path, groups: ProcessGroups, startup: StartupClock) -> int:
    """Train the run described by `run_dir` with this process's `groups`; returns the process exit code.
    `startup` times the phases before the first step (keel/training/observe/timeline.py)."""
    with startup.phase("run dir"):
        cfg, ds_raw, data = read_run_dir(run_dir)
    with startup.phase("rendezvous"):
        init_distributed()
    rank = dist.get_rank()
    setup_logging(rank)
    log = logging.getLogger("keel")
    parallel = cfg.parallel
    with startup.phase("process groups"):
        topology = Topology.from_env(
            tp=parallel.tp,
            pp=parallel.pp,
            ep=parallel.ep,
            sp=parallel.sp,
            cp=parallel.cp,
            pipeline_schedule=parallel.pipeline_schedule,
            virtual_stages=parallel.virtual_stages,
            groups=groups,
        )
    if cfg.logging.collective_trace:
        topology.trace_into(RunDir(run_dir).collectives)
    seed_everything(data_parallel_seed(cfg.train.seed, topology))
    with startup.phase("data"):
        train_samples, order, val_samples = open_splits(
            data, cfg.data.seq_len, cfg.data.val_fraction, cfg.train.seed
        )
    checkpointer = Checkpointer(
        checkpoint_dir(run_dir, cfg, rank),
        cfg.checkpoint.keep_last,
        topology,
        AnomalyLog(run_dir, rank),
    )
    memory = None
    if cfg.checkpoint.memory_interval:
        memory = MemoryCheckpoints(
            Path(cfg.checkpoint.memory_dir),
            cfg.checkpoint.memory_interval,
            topology,
            run_dir,
            AnomalyLog(run_dir, rank),
        )
        if (
            cfg.checkpoint.resume
        ):  # newer than disk in memory: no disk checkpoint to verify or reshard
            with startup.phase("memory restore"):
                latest = checkpointer.latest_tag() if rank == 0 else None
                memory.agree(step_of(latest) if latest else None)
    try:
        if memory is None or memory.restored is None:
            with startup.phase("reshard"):
                ds_raw = reshard_if_needed(cfg, ds_raw, topology, checkpointer, run_dir)
    except CheckpointDisagreement as err:  # before the engine exists: nothing to release
        return checkpoint_disagreement(run_dir, rank, err)
    lr_scale = LRScale()
    with startup.phase("engine"):
        engine = build_engine(
            cfg, ds_raw, topology, lr_scale=lr_scale, document_eos=document_eos(cfg, data)
        )
    if rank == 0:
        n_params = sum(p.numel() for p in engine.module.parameters())
        log.info(
            "%s | %.2fM params | %d train samples of %d tokens | run dir %s",
            topology.describe(),
            n_params / 1e6,
            len(train_samples),
            cfg.data.seq_len,
            run_dir,
        )
    try:
        result = Trainer(
            cfg,
            engine,
            topology,
            train_samples,
            val_samples,
            run_dir,
            lr_scale,
            order,
            checkpointer,
            startup,
            memory,
        ).fit()
    # resume or rollback: every rank raised it, after one agreed gather
    except CheckpointDisagreement as err:
        return checkpoint_disagreement(run_dir, rank, err)
    finally:
        release_run(engine)
    if rank == 0:
        verb = "finished" if result.finished else "stopped early"
        log.info(
            "%s at step %d; checkpoint in %s", verb, result.state.step, RunDir(run_dir).checkpoints
        )
        timeline.append(run_dir, timeline.end_record(result.state.step, result.exit_code))
        summary = write_summary(run_dir, result.finished, result.exit_code, result.reason)
        log.info("summary: %s", summary)
    if result.exit_code:
        # a guard stopped the run; peers stop at the same step with the same code
        return result.exit_code
    comm.barrier(topology.control("world"))
    return ExitCode.OK


def checkpoint_disagreement(run_dir: Path, rank: int, err) -> int:
    """Every rank stops with the same code; rank 0 says why in one line, the anomaly log and the summary."""
    if rank == 0:
        logging.getLogger("keel").error("stopping: %s", err)
        AnomalyLog(run_dir, rank).record(err.anomaly, 0, reason=str(err))
        write_summary(run_dir, False, err.exit_code, str(err))
    return err.exit_code


def release_run(engine) -> None:
    """Free what one run held so the next run in this process starts clean: the engine's buffers and DeepSpeed's
    references to the groups it was handed (the groups themselves stay in the process's `ProcessGroups`, for the
    next run's Topology)."""
    engine.destroy()
    forget_run_groups()


def exit_now(code: int) -> None:
    """Flush and leave without interpreter teardown: gloo can abort in its destructors after a clean run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_sequence(run_dirs: list[Path]) -> int:
    """Train each run dir in turn in this world. A run a guard stops (its exit code is in its summary) does not
    stop the sequence — every rank agreed on it, so the world is still in step; an exception does. Returns the
    highest exit code."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts:  # back off before rejoining: a failing node or filesystem often needs a moment
        time.sleep(min(2 ** (restarts - 1), 30))
    code = ExitCode.OK
    groups = ProcessGroups()  # created once, reused by every run here, destroyed after the last
    started, before = process_started(), "imports"
    for run_dir in run_dirs:
        code = max(code, run_rank(run_dir, groups, StartupClock(started, before)))
        started, before = time.time(), "other"  # the next run's start-up starts here
    # not after an exception: a peer may still be inside a collective of these groups
    groups.destroy()
    return code


def rank_main(argv: list[str]) -> int:
    """One rank: train each run dir in `argv`; returns the exit code (an exception is logged: ExitCode.FAILED)."""
    if not argv:
        print("usage: python -m keel.training.entry RUN_DIR [RUN_DIR ...]", file=sys.stderr)
        return ExitCode.USAGE
    try:
        return run_sequence([Path(arg) for arg in argv])
    except Exception:
        logging.getLogger("keel").exception("rank failed")
        return ExitCode.FAILED


def main() -> None:
    exit_now(rank_main(sys.argv[1:]))


if __name__ == "__main__":
    main()
