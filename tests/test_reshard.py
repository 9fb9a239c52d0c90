"""The universal conversion spread over ranks (keel/training/checkpoint/reshard.py).

Which ranks convert; the waiting ranks' heartbeat on the store (a conversion may take as long as it takes, a dead
rank 0 is seen in seconds, a failed one is named); and, in a spawned 2-rank world, DeepSpeed's conversion split
over both ranks writes what `ds_to_universal` writes alone, file for file, on ZeRO-1 and ZeRO-3 checkpoints. The
real resumes on another layout (tests/test_recovery.py, test_moe_reshard.py, test_pipeline_schedules.py) run the
spread conversion end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from keel.launcher.local import free_port
from keel.training.checkpoint.reshard import Heartbeat, converters, wait_for_rank0
from tests.spawned import rank_env, start_world


def test_converters_take_one_rank_per_node_first_and_at_most_the_cap():
    assert converters(1, 1) == [0]
    assert converters(2, 2) == [0, 1]  # one node: its ranks
    assert converters(16, 8, most=2) == [0, 8]  # two nodes: each node's first rank
    assert converters(16, 8, most=4) == [0, 1, 8, 9]
    assert (
        converters(4096, 8) == list(range(0, 4096, 8))[:32]
    )  # 512 nodes: the first 32 nodes' first ranks
    assert converters(3, 8) == [0, 1, 2]  # fewer ranks than a node holds


def test_a_waiting_rank_sees_progress_while_rank0_beats_and_returns_on_its_verdict():
    store = dist.HashStore()
    beats = []
    heartbeat = Heartbeat(store, "k", interval_s=0.05)
    done = threading.Timer(0.6, lambda: heartbeat.stop(""))
    done.start()
    wait_for_rank0(store, "k", lambda: beats.append(1), interval_s=0.05, stale_s=5.0)
    assert len(beats) >= 2  # each beat restarted the waiting rank's watchdog clock


def test_a_waiting_rank_raises_in_one_line_when_rank0_stops_beating():
    store = dist.HashStore()
    store.set("k/beat", "1")  # rank 0 beat once, then died
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 stopped beating \d+ s ago .*see rank 0's log"):
        wait_for_rank0(store, "k", lambda: None, interval_s=0.05, stale_s=0.3)
    assert time.monotonic() - start < 30  # not the process group's 30-minute collective timeout


def test_a_waiting_rank_raises_rank0s_error():
    store = dist.HashStore()
    Heartbeat(store, "k", interval_s=0.05).stop("OSError: [Errno 28] No space left on device")
    with pytest.raises(RuntimeError, match="could not convert .*No space left on device"):
        wait_for_rank0(store, "k", lambda: None, interval_s=0.05)


# -- the spread conversion equals DeepSpeed's own, on a real checkpoint (2 spawned ranks) --------------------------
KINDS = ["zero1", "zero3"]  # the two paths of ds_to_universal


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__") and type(a) is type(b):  # DeepSpeed's config objects: no __eq__
        return _same(vars(a), vars(b))
    return a == b


def _compare(reference: Path, spread: Path) -> dict:
    want = sorted(p.relative_to(reference) for p in reference.rglob("*") if p.is_file())
    got = sorted(p.relative_to(spread) for p in spread.rglob("*") if p.is_file())
    differ = [
        str(name)
        for name in want
        if name in got
        and not _same(
            torch.load(reference / name, weights_only=False),
            torch.load(spread / name, weights_only=False),
        )
    ]
    return {"files": len(want), "same_names": want == got, "differ": differ}


def _worker(rank: int, port: int, root: str, kind: str) -> None:
    rank_env(rank, 2, port)
    from keel.adapters.deepspeed_internals import convert_to_universal
    from keel.engine.distributed import init_distributed
    from keel.parallel import comm
    from keel.parallel.topology import Topology
    from keel.training.checkpoint.reshard import Share
    from tests.test_adapters import _engine
    from tests.test_async_checkpoint import _train_step

    init_distributed()
    engine = _engine(kind)  # a world of its own: its Topology's groups are its own
    _train_step(engine, 1)
    directory = Path(root) / kind
    engine.save_checkpoint(str(directory), tag="step1")
    group = Topology.from_env().subgroup("converters", [0, 1], comm.CONTROL)
    comm.barrier(group)
    if rank == 0:  # DeepSpeed's own, alone, on a copy (its output must not sit in its input)
        alone = Path(root) / f"{kind}-alone"
        alone.mkdir()
        for f in (directory / "step1").iterdir():
            os.link(f, alone / f.name)
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
        command += ["--input_folder", str(alone), "--output_folder", str(Path(root) / "reference")]
        command += [
            "--inject_missing_state",
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ]
        subprocess.run(command, check=True, capture_output=True)
    done = []
    out = Path(root) / "spread"
    convert_to_universal(
        str(directory / "step1"), str(out), Share(group, lambda: done.append(1)), rank == 0
    )
    per_rank = comm.all_gather_object(len(done), group)
    if rank == 0:
        result = {**_compare(Path(root) / "reference", out), "items": per_rank}
        (Path(root) / "results.json").write_text(json.dumps(result))
    comm.barrier(comm.world_control())
    os._exit(0)  # gloo can abort at interpreter exit


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_conversion_spread_over_two_ranks_writes_what_deepspeed_writes_alone(tmp_path, kind):
    start_world(_worker, (free_port(), str(tmp_path), kind), 2)
    got = json.loads((tmp_path / "results.json").read_text())
    assert got["files"] > 0 and got["same_names"] and got["differ"] == [], got
    assert all(n > 0 for n in got["items"]), got  # both ranks took part in both phases' work
