"""At most one host sync per optimizer step from Keel's own code: counted, not guessed.

A real one-rank `keel train` loop (ZeRO-0 fp32, where Keel clips; ZeRO-1, where DeepSpeed does; an MoE model)
runs in a spawned process that counts every read of a tensor's value to the host made by a frame in `keel/`:
`aten._local_scalar_dense` (`.item()`, `float()`, `bool()`) through a dispatch mode, and `.tolist()` / `.cpu()` /
`.numpy()` copies. On a GPU each such read stalls the host until the device catches up. Reads of what a
*control* collective returned are CPU by design (keel/parallel/comm.py) and not counted, nor are the at-sample
vocabulary check's reads of the step's token batch (keel/data/token_check.py), which is host memory (pinned on CUDA)
until the forward moves it, and is read by the prefetch worker unless the prefetch missed; reads inside DeepSpeed
or torch are theirs. On CPU nothing stalls, so only the count can be checked here.
"""

from __future__ import annotations

import collections
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch

from keel.launcher.local import free_port
from tests.keel_runs import REPO
from tests.spawned import start_world

STEPS = 6
MOE = dict(model__moe_experts=4, stability__expert_interval=0)
HOST_BATCH_CHECK = "data/token_check.py"  # reads the token batch in host memory: no device stall
MICRO_BATCHES, LAYERS = (
    4,
    2,
)  # tests/keel_runs.py TINY: global batch 8 of micro-batches of 2, 2 blocks
KEEL = str(REPO / "keel") + os.sep
PLUMBING = (
    "torch/_tensor.py",
    "torch/overrides.py",
    "torch/_compile.py",
    "torch/_dynamo/",
    "torch/utils/_python_dispatch.py",
    __file__,
)


def _keel_site() -> str | None:
    """The innermost frame that is not torch's dispatch plumbing (or this file), if it is Keel's."""
    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in PLUMBING):
            return (
                f"{frame.filename.removeprefix(KEEL)}:{frame.lineno}"
                if frame.filename.startswith(KEEL)
                else None
            )
    return None


def _count_reads(run_dirs: list[Path]) -> dict[str, int]:
    from torch.utils._python_dispatch import TorchDispatchMode

    from keel.parallel import comm
    from keel.training.entry import run_sequence

    reads: collections.Counter = collections.Counter()

    def counted(tensor: torch.Tensor) -> None:
        site = _keel_site()
        if (
            site
            and not getattr(tensor, "_keel_control", False)
            and not site.startswith(HOST_BATCH_CHECK)
        ):
            reads[site] += 1

    def tag_control(collective):
        def call(tensor, group, *args, **kwargs):
            out = collective(tensor, group, *args, **kwargs)
            if group.channel == comm.CONTROL:
                out._keel_control = True
            return out

        return call

    for name in ("all_reduce", "broadcast"):
        setattr(comm, name, tag_control(getattr(comm, name)))
    for name in ("tolist", "cpu", "numpy"):

        def read(self, *args, _method=getattr(torch.Tensor, name), **kwargs):
            counted(self)
            return _method(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)

    class ScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                counted(args[0])
            return func(*args, **(kwargs or {}))

    with ScalarReads():
        code = run_sequence(run_dirs)
    assert code == 0, code
    return dict(reads)


def _worker(_rank: int, port: int, run_dirs: list[str], out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    try:
        torch.save({d: _count_reads([Path(d)]) for d in run_dirs}, out)
    finally:
        sys.stdout.flush()
        os._exit(0)  # gloo can abort at interpreter exit


@pytest.fixture(scope="module")
def reads(runs, tmp_path_factory) -> dict[str, dict[str, int]]:
    from keel.launcher.run_spec import build_run, prepare_data, write_run_dir

    root = tmp_path_factory.mktemp("host_syncs")
    run_dirs = {}
    for name, ds, changes in (
        ("zero0", "zero0", {}),
        ("zero1", "zero1", {}),
        ("moe", "zero1", MOE),
    ):
        spec = build_run(
            None,
            runs.overrides(train__steps=STEPS, **changes),
            str(REPO / "ds_configs" / f"{ds}.json"),
            str(root / name),
            1,
        )
        prepare_data(spec)
        write_run_dir(spec)
        run_dirs[name] = str(root / name)
    out = root / "reads.pt"
    start_world(_worker, (free_port(), list(run_dirs.values()), str(out)), 1)
    counted = torch.load(out)
    return {ds: counted[path] for ds, path in run_dirs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("ds", ["zero0", "zero1"])
def test_at_most_one_host_sync_per_step_from_keel(reads, ds):
    """Six steps, start-up and the final checkpoint included: at most six reads, all the step's one read-back —
    plus one per checkpoint save (one here: the final), the corrupt-state gate's verdict before anything is written
    (keel/training/guards/state.py; a save synchronises with the device anyway)."""
    got = dict(reads[ds])
    saves = sum(got.pop(site) for site in list(got) if site.startswith("training/guards/state.py"))
    assert sum(got.values()) <= STEPS and saves <= 1, reads[ds]
    assert all(site.startswith("training/trainer.py") for site in got), got


@pytest.mark.slow
def test_moe_reads_its_routing_counts_once_per_layer(reads):
    """Routing needs the per-expert row counts on the host (the all-to-all's split sizes): one read per MoE layer
    and micro-batch forward, none in backward; everything else is the step's one read-back."""
    got = dict(reads["moe"])
    assert (
        sum(got.pop(site) for site in list(got) if site.startswith("training/guards/state.py")) <= 1
    )  # the save
    step = {site: n for site, n in got.items() if site.startswith("training/trainer.py")}
    routing = {site: n for site, n in got.items() if site.startswith("parallel/experts.py")}
    assert sum(step.values()) <= STEPS and set(got) == set(step) | set(routing), got
    assert sum(routing.values()) == STEPS * MICRO_BATCHES * LAYERS, routing


def test_the_count_sees_a_stray_item():
    """The counter is not blind: an `.item()` and a `.tolist()` in a Keel frame are both counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class ScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                seen.append(func)
            return func(*args, **(kwargs or {}))

    with ScalarReads():
        torch.ones(()).item()
    assert seen
    # frames are attributed by file: a frame under keel/ counts, this test file does not
    assert _keel_site() is None
    code = compile("site()", str(REPO / "keel" / "fake.py"), "eval")
    assert eval(code, {"site": _keel_site}) == "fake.py:1"
