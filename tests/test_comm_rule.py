"""The communication rule (keel/parallel/comm.py): Keel's collectives go through one module, each on a channel.

A lint over `keel/` (pure `ast`): no `torch.distributed` (or `deepspeed.comm`) collective is called anywhere but
in keel/parallel/comm.py — a direct call is how a CPU tensor meets a CUDA one in one collective (the hang the rule
exists for). The checker is shown to catch the pipeline loss's old form, so the test can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from keel.parallel import comm

KEEL = Path(__file__).resolve().parents[1] / "keel"
COMM = KEEL / "parallel" / "comm.py"
DIST_MODULES = {"torch.distributed", "deepspeed.comm"}
COLLECTIVES = {
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "inference_all_reduce",
}


# a group's life: created by its members once per process, destroyed at teardown (keel/parallel/process_groups.py)
GROUP_LIFECYCLE = {"new_group", "split_group", "new_subgroups", "new_subgroups_by_enumeration"}
GROUP_LIFECYCLE_OWNERS = {
    KEEL / "parallel" / "process_groups.py",
    # the fake world's own teardown (it replaces new_group and split_group to count them)
    KEEL / "engine" / "simulated_world.py",
}


def direct_collectives(
    source: str, names: set[str] | frozenset[str] = frozenset(COLLECTIVES)
) -> list[tuple[int, str]]:
    """(line, call) for every call of `names` (the collectives) `source` makes on torch.distributed /
    deepspeed.comm, however imported."""
    tree = ast.parse(source)
    modules: set[str] = set()  # local names bound to a distributed module
    functions: dict[str, str] = {}  # local name → collective imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in DIST_MODULES:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in DIST_MODULES:
                    modules.add(alias.asname or alias.name)
                elif node.module in DIST_MODULES and alias.name in names:
                    functions[alias.asname or alias.name] = alias.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in functions:
            found.append((node.lineno, functions[func.id]))
        elif isinstance(func, ast.Attribute) and func.attr in names:
            owner = ast.unparse(func.value)
            if owner in modules or owner in DIST_MODULES:
                found.append((node.lineno, f"{owner}.{func.attr}"))
    return found


def test_no_collective_outside_comm():
    offenders = []
    for path in sorted(KEEL.rglob("*.py")):
        if path == COMM:
            continue
        offenders += [
            f"{path.relative_to(KEEL.parent)}:{line}: {call}"
            for line, call in direct_collectives(path.read_text())
        ]
    assert not offenders, (
        "collectives must go through keel/parallel/comm.py with a channel:\n" + "\n".join(offenders)
    )


def test_groups_are_made_and_destroyed_in_one_place():
    """A group created outside ProcessGroups is world-wide on every rank and never destroyed."""
    names = GROUP_LIFECYCLE | {"destroy_process_group"}
    offenders = [
        f"{path.relative_to(KEEL.parent)}:{line}: {call}"
        for path in sorted(KEEL.rglob("*.py"))
        if path not in GROUP_LIFECYCLE_OWNERS
        for line, call in direct_collectives(path.read_text(), names)
    ]
    assert not offenders, (
        "process groups are created and destroyed by keel/parallel/process_groups.py:\n"
        + "\n".join(offenders)
    )
    # the pair groups preflight made on cbd7c25
    assert direct_collectives(
        "import torch.distributed as dist\nh = [dist.new_group(list(p)) for p in pairs]\n", names
    ) == [(2, "dist.new_group")]


OLD_PIPELINE_LOSS = """
import torch.distributed as dist

def _pipeline_loss(self):
    summed = pipeline_summed_loss(self.engine)
    local = torch.zeros(())
    if summed is not None:
        local = summed.detach().float()
    dist.all_reduce(local)
"""


@pytest.mark.parametrize(
    "source, expected",
    [
        (OLD_PIPELINE_LOSS, [(9, "dist.all_reduce")]),
        ("import torch\ntorch.distributed.barrier()\n", [(2, "torch.distributed.barrier")]),
        (
            "from torch.distributed import all_gather_object as g\ng([], 1)\n",
            [(2, "all_gather_object")],
        ),
        (
            "from torch import distributed\ndistributed.broadcast(t, 0)\n",
            [(2, "distributed.broadcast")],
        ),
        ("import deepspeed.comm as dc\ndc.all_reduce(t)\n", [(2, "dc.all_reduce")]),
        ("import torch.distributed as dist\ndist.get_rank()\ncomm.all_reduce(t, g)\n", []),
    ],
)
def test_the_lint_sees_direct_collectives(source, expected):
    assert direct_collectives(source) == expected


def test_a_tensor_on_the_wrong_device_for_its_channel_is_refused():
    gpu_world = comm.Group("world", (0, 1), 0, comm.DEVICE, device_type="cuda")
    # the old pipeline loss on GPUs
    with pytest.raises(RuntimeError, match="needs a cuda tensor, got one on cpu"):
        comm.check("all_reduce_sum", gpu_world, torch.zeros(()))
    control = comm.Group("world", (0, 1), 0, comm.CONTROL, device_type="cuda")
    with pytest.raises(
        RuntimeError, match="control channel .* needs a cpu tensor, got one on meta"
    ):
        comm.check("all_reduce_max", control, torch.zeros((), device="meta"))
    with pytest.raises(RuntimeError, match="Python objects belongs on the control channel"):
        comm.check("all_gather_object", gpu_world, None)
    # right device: accepted
    comm.check("all_reduce_max", control, torch.zeros(2, dtype=torch.int64))
    comm.check("all_gather_object", control, None)


def test_one_process_collectives_are_the_identity():
    group = comm.single()
    t = torch.arange(3.0)
    assert comm.all_reduce(t, group) is t and comm.all_gather(t, group) == [t]
    assert comm.all_gather_object({"a": 1}, comm.single(channel=comm.CONTROL)) == [{"a": 1}]
    assert comm.broadcast_object(5, comm.single(channel=comm.CONTROL)) == 5
