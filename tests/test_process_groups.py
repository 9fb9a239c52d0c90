"""A process's groups are created once and reused (keel/parallel/process_groups.py): the threads of a shared launch
stay flat from run to run.

Every gloo group holds its own threads (a run loop and a TCP loop per connection) until it is destroyed. On
cbd7c25 each run of a shared launch (`run_sequence`) created every group of every kind again — and DeepSpeed its
pipeline grid — and none was destroyed: a suite's 66-run launch ended with ~2,300 threads per rank. Here a real
2-rank gloo world trains four runs of different layouts in one launch, and each rank counts its threads after each.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from keel.launcher.local import free_port
from tests.keel_runs import REPO
from tests.spawned import start_world

LAYOUTS = {
    "dp2": {},
    "pp2": {"parallel.pp": 2},
    "tp2": {"parallel.tp": 2},
    "ep2": {"parallel.ep": 2, "model.moe_experts": 2, "stability.expert_interval": 0},
}
SLACK = 8  # threads a run may leave behind that do not grow with runs (a pool grown once, a prefetch worker)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _worker(rank: int, port: int, run_dirs: list[str], out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )
    from keel.training import entry

    counts, created = [], []
    run_rank = entry.run_rank

    def counted(run_dir, groups, startup):
        code = run_rank(run_dir, groups, startup)
        counts.append(_threads())
        created.append(len(groups.created()))
        return code

    entry.run_rank = counted
    code = 1
    try:
        code = entry.run_sequence([Path(d) for d in run_dirs])
        torch.save({"code": int(code), "threads": counts, "created": created}, f"{out}.{rank}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)  # gloo can abort at interpreter exit


@pytest.mark.slow
def test_threads_stay_flat_across_a_shared_launch(runs, tmp_path):
    from keel.launcher.run_spec import build_run, prepare_data, write_run_dir

    run_dirs = []
    for name, changes in LAYOUTS.items():
        spec = build_run(
            None,
            runs.overrides(train__steps=2, **{k.replace(".", "__"): v for k, v in changes.items()}),
            str(REPO / "ds_configs" / "zero1.json"),
            str(tmp_path / name),
            2,
        )
        prepare_data(spec)
        write_run_dir(spec)
        run_dirs.append(str(tmp_path / name))
    out = tmp_path / "threads"
    start_world(_worker, (free_port(), run_dirs, str(out)), 2)
    for rank in range(2):
        seen = torch.load(f"{out}.{rank}")
        assert seen["code"] == 0
        threads = seen["threads"]
        assert len(threads) == len(LAYOUTS)
        assert max(threads) <= threads[0] + SLACK, f"rank {rank}: threads after each run {threads}"
        # at world 2 the only group of two is the world (the default group): only groups of one, on
        # DeepSpeed's request (its model-parallel group at tp=1), are ever created, once
        assert seen["created"][-1] <= 1, seen["created"]


def _pairs_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="3"
    )
    from keel.parallel.process_groups import ProcessGroups

    try:
        dist.init_process_group("gloo", rank=rank, world_size=3)
        groups, sums = ProcessGroups(), []
        # preflight's ring at 3 ranks: each round a pair the third rank is not in
        for pair in ((0, 1), (1, 2), (0, 2)):
            if rank in pair:
                t = torch.ones(1)
                dist.all_reduce(t, group=groups.get(pair))
                sums.append(int(t.item()))
            dist.barrier()
        groups.destroy()
        torch.save(sums, f"{out}.{rank}")
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        os._exit(0)


@pytest.mark.slow
def test_groups_of_some_ranks_after_others_do_not_hang(tmp_path):
    """torch salts a locally synchronized group's name with how many groups the process holds: after a pair the
    third rank is not in, the next pair's members named it differently and waited forever (the 3-rank preflight
    hung). Named by their ranks alone, every pair meets."""
    start_world(_pairs_worker, (free_port(), str(tmp_path / "sums")), 3)
    assert [torch.load(tmp_path / f"sums.{r}") for r in range(3)] == [[2, 2], [2, 2], [2, 2]]
