"""Start the ranks on this machine through torchrun's API (the same agent `torchrun` uses)."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from keel.launcher.oom import killed_for_memory, oom_kills


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(run_dir: Path | list[Path], nproc: int, max_restarts: int = 0) -> int:
    """Run `python -m keel.training.entry RUN_DIR [RUN_DIR ...]` on `nproc` local ranks (several run dirs train
    one after another in the same world); returns 0 when all succeeded."""
    run_dirs = [str(d) for d in (run_dir if isinstance(run_dir, list) else [run_dir])]
    return launch_module(
        ["keel.training.entry", *run_dirs],
        nproc,
        max_restarts,
        "training",
        " ".join(run_dirs),
        lambda: memory_figure(Path(run_dirs[0]), nproc),
    )


def memory_figure(run_dir: Path, nproc: int) -> str:
    """What the memory model puts on each rank of this run, and what the host has: for a rank killed for memory."""
    import psutil

    from keel.run_dir import read_run_dir
    from keel.tools.preflight.memory import run_needs

    cfg, ds_raw, _ = read_run_dir(run_dir)
    needs = run_needs(cfg, ds_raw, nproc)
    per_rank = (needs.rank_state_bytes + needs.host_bytes) / 2**30
    return (
        f"the memory model puts each rank at {per_rank:.3g} GiB (state, activations in flight and host copies), "
        f"{nproc} rank(s) on a host of {psutil.virtual_memory().total / 2**30:.3g} GiB: lower "
        "train.micro_batch_size or data.seq_len, set train.activation_checkpoint_interval, or use more ranks "
        "(`keel preflight` judges it before a run)"
    )


def launch_module(
    module_args: list[str],
    nproc: int,
    max_restarts: int = 0,
    what: str = "training",
    where: str = "the run dir",
    memory_note: Callable[[], str] | None = None,
) -> int:
    """Run `python -m MODULE ARGS...` on `nproc` local ranks; returns 0, or the highest exit code of a rank
    that failed (Keel's documented codes pass through to the caller)."""
    # torch here, not at the top: keel/launcher/cli.py imports this module, and `keel --help` must not load torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torch 2.13's agent otherwise hands its rendezvous TCP store to the workers, which breaks restarts
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does: don't oversubscribe the cores
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"keel-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.5,
    )
    oom_before = oom_kills()
    try:
        elastic_launch(config, sys.executable)("-u", "-m", *module_args)
    except ChildFailedError as exc:
        failures = ", ".join(f"rank {r} exit {f.exitcode}" for r, f in sorted(exc.failures.items()))
        memory = killed_for_memory(
            {r: f.exitcode for r, f in exc.failures.items()}, oom_before, oom_kills()
        )
        if memory:  # a bare -9 says nothing: name memory, and what the model predicted
            note = memory_note() if memory_note is not None else ""
            print(f"keel: {what} failed: {memory}" + (f"; {note}" if note else ""), file=sys.stderr)
        print(f"keel: {what} failed ({failures}); see the log above and {where}", file=sys.stderr)
        codes = [f.exitcode for f in exc.failures.values() if f.exitcode and f.exitcode > 0]
        # keep Keel's documented codes (3 checksum, 4 hang) for the caller
        return max(codes) if codes else 1
    return 0
