"""A simulated world: this process as rank r of N on torch's fake process group, counting traffic.

Keel's users run 512-4,096 GPUs, where start-up time, per-step control traffic and memory that grows
with the world decide whether a job runs at all; none of it shows on the 2-8 gloo ranks the suite
runs. torch's fake backend (`FakeStore` + backend "fake", what torchtitan's COMM_MODE=fake_backend
uses) lets one process be rank r of a world of any size with no peers: every collective returns at
once, moving nothing. `SimulatedWorld` sets that up and, while it is active, counts (patching
`torch.distributed` and `keel.parallel.comm` inside the context only):

- every process-group creation: `new_group` and `split_group`, also when torch's `new_subgroups*` or
  DeepSpeed's `deepspeed.comm.new_group` call them, with the group's ranks and how many ranks must
  take part in creating it (the world for a `new_group` without `use_local_synchronization`: on NCCL
  an eager world-wide split). `split_group` needs a default group bound to an accelerator, which a
  CPU-only torch cannot give the fake backend: there it raises;
- every collective, with Keel's channel (`device` or `control`, from the `comm.Group` handle it went
  through, or `direct` for a call that bypasses keel/parallel/comm.py, such as DeepSpeed's own), op,
  group size and bytes.

Object collectives (`all_gather_object`, ...) are counted, not run: at 4,096 ranks the preflight
records alone would be gigabytes. Each rank gets its own object back in every slot, which is what
the fake backend would give. Not counted: DeepSpeed's `all_gather_into_tensor` and
`reduce_scatter_tensor` when it calls them through the functions its comm backend bound when it was
first created (ZeRO's partition traffic, which only a fully built engine sends).

keel/engine/simulated_construction.py runs one rank's construction in such a world (`construct`);
everything is recorded per phase in a `WorldRecord`; keel/training/simulated_steps.py drives the
step and the periodic checks on top, and keel/engine/scale_report.py reads records
(`render_table`, `scale_bounds_violations`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from keel.adapters.deepspeed_internals import forget_run_groups
from keel.engine.memory_model import RankMemory
from keel.parallel import comm

# Phases a record's entries are filed under (SimulatedWorld.phase); checks are "check:<name>".
TOPOLOGY, MODEL, DEEPSPEED, STEP, PREFLIGHT = "topology", "model", "deepspeed", "step", "preflight"
# the extra collectives of a step while an async save is pending
ASYNC_SAVE_STEP = "step+async_save"
CONSTRUCTION = (TOPOLOGY, MODEL, DEEPSPEED)
CHECK = "check:"
DIRECT = "direct"  # a collective that did not go through keel/parallel/comm.py (DeepSpeed's own)

# torch collectives, with the arguments whose bytes this rank passes in and the op leaves on it
TENSOR_OPS: dict[str, tuple[str | None, str | None]] = {
    "all_reduce": ("tensor", "tensor"),
    "all_reduce_coalesced": ("tensors", "tensors"),
    "all_gather": ("tensor", "tensor_list"),
    "all_gather_into_tensor": ("input_tensor", "output_tensor"),
    "reduce_scatter": ("input_list", "output"),
    "reduce_scatter_tensor": ("input", "output"),
    "all_to_all": ("input_tensor_list", "output_tensor_list"),
    "all_to_all_single": ("input", "output"),
    "broadcast": ("tensor", "tensor"),
    "reduce": ("tensor", "tensor"),
    "gather": ("tensor", "gather_list"),
    "scatter": ("scatter_list", "tensor"),
    "send": ("tensor", None),
    "isend": ("tensor", None),
    "recv": (None, "tensor"),
    "irecv": (None, "tensor"),
    "barrier": (None, None),
    "monitored_barrier": (None, None),
}
OBJECT_OPS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
CREATION_OPS = ("new_group", "split_group")


@dataclass(frozen=True)
class GroupCreation:
    """One call that created a process group, as this rank made it."""

    phase: str
    api: str  # new_group | split_group
    ranks: tuple[int, ...]  # the group this call creates (split_group: this rank's part)
    member: bool  # this rank is in it
    # ranks that must make the call together (the world, unless local synchronization)
    participants: int
    site: str  # the first caller outside torch.distributed and deepspeed.comm, file:line

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class CollectiveCall:
    """One collective this rank entered. `sent`: bytes of what it passes in; `received`: bytes the
    op leaves on it (an all-gather's `received` is the group size times its `sent`)."""

    phase: str
    channel: str  # device | control | direct
    group: str  # Keel's group name ("" for a direct call)
    op: str
    size: int  # ranks in the group
    sent: int
    received: int


@dataclass(frozen=True)
class Held:
    """Something a rank keeps after a phase whose size grows with the world."""

    phase: str
    what: str
    entries: int
    nbytes: int  # of the Python objects, as unpickled on this rank (`deep_size`)


@dataclass
class WorldRecord:
    """Everything one rank of one simulated world did, filed by phase."""

    world_size: int
    rank: int
    label: str = ""
    groups: list[GroupCreation] = field(default_factory=list)
    collectives: list[CollectiveCall] = field(default_factory=list)
    held: list[Held] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)
    parameters: int = 0  # this rank's parameter elements, counted on the meta device
    memory: RankMemory | None = None  # the memory model's prediction for this rank's layout

    def created(self, phases: tuple[str, ...] = CONSTRUCTION) -> list[GroupCreation]:
        return [g for g in self.groups if g.phase in phases]

    def calls(self, phase: str, channel: str | None = None) -> list[CollectiveCall]:
        return [
            c
            for c in self.collectives
            if c.phase == phase and (channel is None or c.channel == channel)
        ]

    def phases(self, prefix: str) -> list[str]:
        """Phases starting with `prefix` that issued collectives, in first-seen order."""
        return list(dict.fromkeys(c.phase for c in self.collectives if c.phase.startswith(prefix)))


def _nbytes(value: Any) -> int:
    """Bytes of a tensor or a list of tensors (anything else: 0)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(v.numel() * v.element_size() for v in value if isinstance(v, torch.Tensor))
    return 0


def pickled_size(obj: Any) -> int:
    """Bytes `obj` takes on the wire in torch's object collectives (they pickle it)."""
    return len(pickle.dumps(obj))


def deep_size(obj: Any) -> int:
    """Bytes of `obj` and of all it references (containers, dataclass fields), each object once."""
    seen: set[int] = set()
    stack, total = [obj], 0
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack += list(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.append(vars(item))
    return total


_PASS_THROUGH = (
    os.path.join("torch", "distributed", ""),
    os.path.join("deepspeed", "comm", ""),
    __file__,
)
_REPO = str(Path(__file__).resolve().parents[2]) + os.sep
_SITE_PACKAGES = "site-packages" + os.sep


def _site() -> str:
    """file:line of the first frame outside torch.distributed, deepspeed.comm and this module."""
    frame = sys._getframe(1)
    while frame is not None and any(part in frame.f_code.co_filename for part in _PASS_THROUGH):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    path = path.split(_SITE_PACKAGES, 1)[1] if _SITE_PACKAGES in path else path.removeprefix(_REPO)
    return f"{path}:{frame.f_lineno}"


def _binder(fn: Callable) -> Callable[[tuple, dict], dict[str, Any]]:
    """A cheap `inspect.signature(fn).bind(...).arguments` for functions without *args (tens of
    thousands of group creations go through it)."""
    names = list(inspect.signature(fn).parameters)
    return lambda args, kwargs: {**dict(zip(names, args)), **kwargs}


class SimulatedWorld:
    """`with SimulatedWorld(4096, 17) as world:` makes this process rank 17 of 4,096 (fake backend).

    Inside, torch.distributed and DeepSpeed's comm see an initialized world; `world.record` collects
    what the code run inside creates and sends, filed under the current `world.phase(name)`. On exit
    every patch is undone, DeepSpeed's group tables are cleared and the process group destroyed, so
    one process can simulate several worlds one after another (not nested: a process has one default
    group).
    """

    def __init__(self, world_size: int, rank: int, ranks_per_node: int = 8):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.world_size, self.rank, self.ranks_per_node = world_size, rank, ranks_per_node
        self.record = WorldRecord(world_size, rank)
        self._phase = ""
        self._keel_groups: list[comm.Group] = []  # the Keel handle of the comm call in progress
        self._inside = False  # in a counted torch call: the calls it makes itself are not counted
        self._patches: list[tuple[object, str, object]] = []
        self._env: dict[str, str | None] = {}

    # -- phases and what is held ---------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """File everything inside under `name`."""
        outer, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = outer

    def hold(self, what: str, entries: int, nbytes: int) -> None:
        """Note that this rank keeps `what` (`entries` long, `nbytes` in memory) after the phase."""
        self.record.held.append(Held(self._phase, what, entries, nbytes))

    # -- entering and leaving -------------------------------------------------------------------
    def __enter__(self) -> SimulatedWorld:
        if dist.is_initialized():
            raise RuntimeError(
                "a process group already exists in this process: a simulated world needs its own"
            )
        from torch.testing._internal.distributed.fake_pg import FakeStore

        # what launchers set and DeepSpeed reads; with LOCAL_SIZE set to the world size, DeepSpeed's
        # CPU shared-memory all-reduce would wait for peers on this host
        env = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "LOCAL_SIZE": None,
        }
        self._env = {k: os.environ.get(k) for k in env}
        _set_env(env)
        try:
            dist.init_process_group(
                "fake", store=FakeStore(), rank=self.rank, world_size=self.world_size
            )
            import deepspeed

            deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False, verbose=False)
            self._install()
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._leave()

    def _leave(self) -> None:
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()
        forget_run_groups()  # the expert groups MoE layers handed DeepSpeed, its mpu
        if dist.is_initialized():
            dist.destroy_process_group()
        _set_env(self._env)

    def _patch(self, owner: object, name: str, replacement: Callable) -> None:
        self._patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _install(self) -> None:
        c10d = dist.distributed_c10d
        for name in (*CREATION_OPS, *TENSOR_OPS, *OBJECT_OPS):
            if not hasattr(c10d, name):
                continue
            original = getattr(c10d, name)
            wrapper = (
                self._creating(name, original)
                if name in CREATION_OPS
                else self._object_op(name, original)
                if name in OBJECT_OPS
                else self._tensor_op(name, original)
            )
            # both namespaces: torch's own helpers call c10d's (new_subgroups calls new_group,
            # batch_isend_irecv calls isend and compares ops with it, send calls isend)
            self._patch(dist, name, wrapper)
            self._patch(c10d, name, wrapper)
        for name, fn in keel_collectives().items():
            self._patch(comm, name, self._through_keel(fn))

    # -- the wrappers ---------------------------------------------------------------------------
    def _creating(self, api: str, original: Callable) -> Callable:
        bind = _binder(original)

        @functools.wraps(original)
        def create(*args, **kwargs):
            if self._inside:
                return original(*args, **kwargs)
            bound = bind(args, kwargs)
            if api == "new_group":
                ranks = tuple(sorted(bound.get("ranks") or range(self.world_size)))
                local = bool(bound.get("use_local_synchronization"))
                participants = len(ranks) if local else self.world_size
            else:
                parent = bound.get("parent_pg")
                parts = bound.get("split_ranks") or []
                ranks = next((tuple(p) for p in parts if self.rank in p), ())
                participants = (
                    dist.get_world_size(parent) if parent is not None else self.world_size
                )
            self._inside = True
            try:
                group = original(*args, **kwargs)
            finally:
                self._inside = False
            self.record.groups.append(
                GroupCreation(self._phase, api, ranks, self.rank in ranks, participants, _site())
            )
            return group

        return create

    def _call(self, op: str, group: Any, sent: int, received: int) -> None:
        keel = self._keel_groups[-1] if self._keel_groups else None
        if keel is not None:
            channel, name, size = keel.channel, keel.name, keel.size
        else:
            channel, name, size = DIRECT, "", dist.get_world_size(group)
        self.record.collectives.append(
            CollectiveCall(self._phase, channel, name, op, size, sent, received)
        )

    def _tensor_op(self, op: str, original: Callable) -> Callable:
        bind = _binder(original)
        sent_arg, received_arg = TENSOR_OPS[op]

        @functools.wraps(original)
        def collective(*args, **kwargs):
            if self._inside:
                return original(*args, **kwargs)
            bound = bind(args, kwargs)
            sent, received = _nbytes(bound.get(sent_arg)), _nbytes(bound.get(received_arg))
            self._call(op, bound.get("group"), sent, received)
            self._inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside = False

        return collective

    def _object_op(self, op: str, original: Callable) -> Callable:
        """Counted, not run: each rank gets its own object (what the fake backend would give)."""
        bind = _binder(original)

        @functools.wraps(original)
        def collective(*args, **kwargs):
            bound = bind(args, kwargs)
            group = bound.get("group")
            n = dist.get_world_size(group)
            if op == "all_gather_object":
                out, obj = bound["object_list"], bound["obj"]
                out[:] = [obj] * len(out)
                sent, received = pickled_size(obj), n * pickled_size(obj)
            elif op == "gather_object":
                out, obj = bound.get("object_gather_list"), bound["obj"]
                if out is not None:
                    out[:] = [obj] * len(out)
                sent, received = pickled_size(obj), n * pickled_size(obj) if out is not None else 0
            elif op == "broadcast_object_list":
                sent = received = pickled_size(bound["object_list"])
            else:  # scatter_object_list
                out, parts = (
                    bound["scatter_object_output_list"],
                    bound.get("scatter_object_input_list"),
                )
                if parts:
                    out[0] = parts[dist.get_rank(group)]
                sent, received = pickled_size(parts) if parts else 0, pickled_size(out[0])
            self._call(op, group, sent, received)

        return collective

    def _through_keel(self, fn: Callable) -> Callable:
        """Keel's collective `fn`, noting its handle: the torch call inside is filed under it."""
        bind = _binder(fn)

        @functools.wraps(fn)
        def keel_collective(*args, **kwargs):
            self._keel_groups.append(bind(args, kwargs)["group"])
            try:
                return fn(*args, **kwargs)
            finally:
                self._keel_groups.pop()

        return keel_collective


def keel_collectives() -> dict[str, Callable]:
    """keel/parallel/comm.py's public functions taking a `group` handle: every Keel collective."""
    found = {}
    for name, fn in vars(comm).items():
        if (
            inspect.isfunction(fn)
            and fn.__module__ == comm.__name__
            and not name.startswith("_")
            and name != "check"
            and "group" in inspect.signature(fn).parameters
        ):
            found[name] = fn
    return found


def _set_env(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
