"""What the corrupt-state check costs (keel/training/guards/state.py): its throughput, and a save gate's time.

A model of `--params` million fp32 parameters with AdamW state (param + exp_avg + exp_avg_sq: 12 bytes a
parameter, what a rank holds at fp32 ZeRO-0; a ZeRO rank holds its partition of the same) is checked by
`nonfinite_state`, interleaved with two yardsticks on the same bytes in the same run:

- `isfinite`: `torch.isfinite(t).all()` per tensor, the obvious check (it allocates a bool copy of each tensor);
- `torch.save`: serializing the same tensors to `--dir` (what a checkpoint save does with them, no fsync).

A save gate is the check plus one one-integer all-reduce over a world of `--ranks` gloo processes (each rank
checks its own copy of the model, as each rank checks its own state): its wall time on rank 0, and the
all-reduce's alone.

    python bench/state_check.py [--params 100] [--repeats 5] [--ranks 2] [--dir /tmp]

Prints GB/s for each method (best of the repeats, with the median), the check's speed over the yardsticks', and
the gate's time in ms and as a fraction of the torch.save time of the same bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from keel.launcher.local import free_port  # noqa: E402
from keel.parallel import comm  # noqa: E402
from keel.training.guards.state import nonfinite_state, state_tensors  # noqa: E402


class _Engine:
    """The two things the check reads: the module's parameters and the torch optimizer (fp32 ZeRO-0's shape)."""

    def __init__(self, million: float, width: int = 4096):
        rows = max(1, int(million * 1e6) // width // 8)
        self.module = torch.nn.Sequential(
            *[torch.nn.Linear(width, rows, bias=False) for _ in range(8)]
        )
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-3)
        for p in self.module.parameters():
            p.grad = torch.zeros_like(p)
        self.optimizer.step()  # creates exp_avg and exp_avg_sq
        for p in self.module.parameters():
            p.grad = None


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    control = comm.world_control()
    engine = _Engine(args.params)
    tensors = [t for _, t in state_tensors(engine)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def gate() -> None:
        count, _ = nonfinite_state(engine)
        comm.all_reduce(torch.tensor([int(count > 0)], dtype=torch.int64), control, "sum")

    def all_reduce() -> None:
        comm.all_reduce(torch.tensor([0], dtype=torch.int64), control, "sum")

    times: dict[str, list[float]] = {
        k: [] for k in ("check", "isfinite", "torch.save", "gate", "all_reduce")
    }
    path = Path(args.dir) / f"state_check_rank{rank}.pt"
    for _ in range(args.repeats):  # interleaved: the machine's noise hits every method alike
        dist.barrier()
        times["check"] += _timed(lambda: nonfinite_state(engine), 1)
        times["isfinite"] += _timed(lambda: [bool(torch.isfinite(t).all()) for t in tensors], 1)
        times["torch.save"] += _timed(lambda: torch.save(tensors, path), 1)
        dist.barrier()
        times["gate"] += _timed(gate, 1)
        dist.barrier()
        times["all_reduce"] += _timed(all_reduce, 1)
    path.unlink(missing_ok=True)
    if rank == 0:
        torch.save({"bytes": nbytes, "times": times}, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100.0, help="million parameters per rank")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where torch.save writes")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp()) / "times.pt"
    mp.start_processes(
        _rank,
        args=(args.ranks, free_port(), args, str(out)),
        nprocs=args.ranks,
        start_method="spawn",
    )
    got = torch.load(out)
    gb, times = got["bytes"] / 1e9, got["times"]
    print(
        f"state per rank: {gb:.2f} GB ({args.params:g}M fp32 params + AdamW moments), {args.ranks} ranks, "
        f"{args.repeats} interleaved repeats, 1 thread per rank"
    )
    speed = {}
    for name in ("check", "isfinite", "torch.save"):
        speed[name] = gb / min(times[name])
        print(
            f"  {name:11s} {speed[name]:7.2f} GB/s best, {gb / statistics.median(times[name]):7.2f} GB/s median"
        )
    print(
        f"  check / isfinite speed: {speed['check'] / speed['isfinite']:.1f}x; check / torch.save speed: "
        f"{speed['check'] / speed['torch.save']:.1f}x"
    )
    gate, reduce = statistics.median(times["gate"]), statistics.median(times["all_reduce"])
    print(
        f"  save gate (check + 1-int all-reduce): {gate * 1e3:.1f} ms median, of which the all-reduce "
        f"{reduce * 1e3:.2f} ms; {gate / statistics.median(times['torch.save']):.3f} of torch.save's time"
    )


if __name__ == "__main__":
    main()
