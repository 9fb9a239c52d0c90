"""`keel plan --check`: the chosen plan's first, a middle and the last rank built in a simulated world.

Each of the three is rank r of the plan's whole world on torch's fake backend (keel/engine/simulated_world.py):
its Topology, its layers on the meta device (no parameter memory) and DeepSpeed's engine as far as it builds
there, one step and each periodic check (keel/training/simulated_steps.py). What a user learns before
allocating the cluster: the process groups each rank creates, the collectives and bytes of a step and a check,
the memory model's figures for the layout, and any scale rule the layout breaks. Here, not in keel/tools/plan:
the simulation drives the training loop's code, which a tool may not import.
"""

from __future__ import annotations

from keel.config import RunConfig
from keel.engine.scale_report import render_table, scale_bounds_violations
from keel.parallel.topology import GridShape
from keel.training.simulated_steps import simulate


def check_ranks(world_size: int) -> list[int]:
    """The first, a middle and the last rank (fewer in a smaller world)."""
    return sorted({0, world_size // 2, world_size - 1})


def check_plan(cfg: RunConfig, ds: dict, world_size: int) -> tuple[str, list[str]]:
    """(the table of the three ranks, the scale rules they break)."""
    parallel = cfg.parallel
    shape = GridShape(
        world_size, tp=parallel.tp, pp=parallel.pp, ep=parallel.ep, sp=parallel.sp, cp=parallel.cp
    )
    records = [simulate(shape, rank, cfg, ds=ds) for rank in check_ranks(world_size)]
    broken = [f"rank {r.rank}: {line}" for r in records for line in scale_bounds_violations(r)]
    return render_table(records), broken
