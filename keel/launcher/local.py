"""Start the ranks on this machine through torchrun's API (the same agent `torchrun` uses).

Ranks are forked from one forkserver per launch that imported the rank's module (torch, DeepSpeed and Keel's
training stack) once: a fresh interpreter per rank would import them once per rank, ~3 s of CPU each, and at
8 ranks a node reading a Python environment off a shared filesystem the imports are most of a job's start-up. An
elastic restart forks again from the same server. The forkserver is single-threaded and touches no GPU (CUDA is
probed through NVML, which is fork-safe), so a forked rank starts as clean as a spawned one. Ranks show as
`keel-rank<R>` in `ps` and `top` (their command line is the forkserver's).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.forkserver
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


# what a training rank imports beyond its module, lazily, in its first engine build and step (torch.compile's
# front end, which DeepSpeed's optimizer imports; the TensorBoard writer; DeepSpeed's op builders): ~2 s a rank
TRAINING_PRELOAD = ["torch._dynamo", "torch.utils.tensorboard", "deepspeed.ops.op_builder.all_ops"]


def launch_local(run_dir: Path | list[Path], nproc: int, max_restarts: int = 0) -> int:
    """Run `python -m keel.training.entry RUN_DIR [RUN_DIR ...]` on `nproc` local ranks (several run dirs train
    one after another in the same world); returns 0 when all succeeded."""
    run_dirs = [str(d) for d in (run_dir if isinstance(run_dir, list) else [run_dir])]
    return launch_module(
        "keel.training.entry",
        run_dirs,
        nproc,
        max_restarts,
        "training",
        " ".join(run_dirs),
        lambda: memory_figure(Path(run_dirs[0]), nproc),
        preload=TRAINING_PRELOAD,
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
    module: str,
    argv: list[str],
    nproc: int,
    max_restarts: int = 0,
    what: str = "training",
    where: str = "the run dir",
    memory_note: Callable[[], str] | None = None,
    preload: list[str] | None = None,
) -> int:
    """Run `MODULE.rank_main(argv)` on `nproc` local ranks, forked from a server that imported MODULE; returns
    0, or the highest exit code of a rank that failed (Keel's documented codes pass through to the caller).
    `preload`: modules the ranks import later, imported by the server too."""
    # torch here, not at the top: keel/launcher/cli.py imports this module, and `keel --help` must not load torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torch 2.13's agent otherwise hands its rendezvous TCP store to the workers, which breaks restarts
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does: don't oversubscribe the cores
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # the forkserver's imports ask torch whether CUDA is there: through NVML, so no CUDA context is forked
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    multiprocessing.set_forkserver_preload([module, *(preload or [])])
    # a forked rank that leaves with a code is reported with torch's traceback of its own join: Keel's line
    # below names the code, as it did for a spawned rank
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, WithoutTraceback) for f in agent_log.filters):
        agent_log.addFilter(WithoutTraceback())
    # the server imports while the agent sets itself up (its store, the rendezvous), on another core
    multiprocessing.forkserver.ensure_running()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"keel-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.5,
        start_method="forkserver",
    )
    oom_before = oom_kills()
    try:
        elastic_launch(config, run_rank_main)(module, argv)
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


class WithoutTraceback(logging.Filter):
    """Keep a record's message, drop its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def run_rank_main(module: str, argv: list[str]) -> None:
    """A forked rank: name the process, run `module.rank_main(argv)`, and leave with its code. A clean end
    returns (the agent collects each rank's return before it lets them exit); a failure leaves at once without
    interpreter teardown (gloo can abort in its destructors)."""
    name_process(f"keel-rank{os.environ.get('RANK', '')}")
    # as `python -u`: a rank's lines reach the log as they happen
    sys.stdout.reconfigure(line_buffering=True)
    code = importlib.import_module(module).rank_main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)


def name_process(name: str) -> None:
    """The name `ps`, `top` and `pgrep` show (Linux: 15 characters; elsewhere nothing)."""
    try:
        Path("/proc/self/comm").write_text(name[:15])
    except OSError:
        pass
