"""The rank grid and its process groups, passed explicitly to everything that communicates.

Grid order, outermost to innermost: pp, edp, ep, cp, sp, tp. Tensor parallel is innermost so the ranks of one TP
group are adjacent (one node's NVLink island); Ulysses sp (an all-to-all per attention) and then context parallel
(a ring of point-to-point K/V transfers, overlapped with attention) come next, so they stay inside a node when
tp·sp·cp fits one and the ring is the first to cross nodes when it does not; pipeline is outermost so stages can
span nodes. cp and sp ranks split one sequence (the `seq` group) and replicate the parameters, as DeepSpeed's
"sequence parallel" ranks do. Expert parallel is
carved out of data parallel, as in DeepSpeed-MoE: dense parameters are data-parallel over (edp × ep), expert
parameters only over edp.

A `Topology` also serves as the `mpu` object DeepSpeed accepts, so ZeRO partitions over the data-parallel group
and DeepSpeed's gradient-norm and overflow reductions span the model-parallel group.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from keel.config import validate_world_size
from keel.parallel import comm
from keel.parallel.process_groups import ProcessGroups

AXES = ("pp", "edp", "ep", "cp", "sp", "tp")


@dataclass(frozen=True)
class GridShape:
    """Sizes of every parallel dimension; `dp` is the dense data-parallel size (edp × ep)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp * self.sp)

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    def sizes(self) -> dict[str, int]:
        return {
            "pp": self.pp,
            "edp": self.edp,
            "ep": self.ep,
            "cp": self.cp,
            "sp": self.sp,
            "tp": self.tp,
        }

    def check(self) -> None:
        """Raise ConfigError (a ValueError) naming the field when the world does not factor into this grid.

        `keel.config.rules` checks the same rule before launch, for the world size the launch planned. This
        one is the world the process group actually has, and some paths never validated a config for it:
        `python -m keel.training.entry RUN_DIR` reads a run dir written for whatever world size it was prepared
        for, and lr-find, tests and benchmarks call `from_env` with no config at all. So it runs here too, by
        calling the config's rule rather than restating it.
        """
        validate_world_size(
            self.world_size, tp=self.tp, pp=self.pp, sp=self.sp, ep=self.ep, cp=self.cp
        )

    def coords(self, rank: int) -> dict[str, int]:
        coords = {}
        for axis in reversed(AXES):
            size = self.sizes()[axis]
            coords[axis] = rank % size
            rank //= size
        return coords

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for axis in AXES:
            rank = rank * self.sizes()[axis] + coords[axis]
        return rank

    def groups_along(self, axes: tuple[str, ...]) -> list[list[int]]:
        """All rank lists that vary only along `axes` (every other coordinate fixed), in a fixed order."""
        sizes = self.sizes()
        fixed = [a for a in AXES if a not in axes]
        groups = []
        for fixed_values in itertools.product(*(range(sizes[a]) for a in fixed)):
            base = dict(zip(fixed, fixed_values))
            ranks = []
            for varying in itertools.product(*(range(sizes[a]) for a in axes)):
                ranks.append(self.rank_of({**base, **dict(zip(axes, varying))}))
            groups.append(sorted(ranks))
        return groups

    def group_of(self, rank: int, axes: tuple[str, ...]) -> list[int]:
        """The ranks of `rank`'s group along `axes` (its other coordinates fixed), sorted: O(group size)."""
        sizes, coords = self.sizes(), self.coords(rank)
        return sorted(
            self.rank_of({**coords, **dict(zip(axes, varying))})
            for varying in itertools.product(*(range(sizes[a]) for a in axes))
        )


# Which grid axes each named group spans.
GROUP_AXES = {
    "tp": ("tp",),
    "pp": ("pp",),
    "sp": ("sp",),
    "cp": ("cp",),
    "seq": (
        "cp",
        "sp",
    ),  # the ranks splitting one sequence: the loss mean, the router's token counts
    "ep": ("ep",),
    "dp": ("edp", "ep"),  # dense data parallel
    "edp": ("edp",),  # expert data parallel
    "model": (
        "pp",
        "tp",
    ),  # ranks holding different parameters of one model replica (sp and cp ranks replicate)
    "tp_sp": ("sp", "tp"),
    "stage": ("edp", "ep", "cp", "sp", "tp"),  # every rank of one pipeline stage
    "sp_dp": (
        "edp",
        "ep",
        "cp",
        "sp",
    ),  # ranks holding the same dense parameters: ZeRO's and gradient reduction's group
    "expert_dp": (
        "edp",
        "cp",
        "sp",
    ),  # ranks holding the same experts (sequence-splitting ranks replicate them too)
}
# Topology.stamp() keys older checkpoints lack
STAMP_DEFAULTS = {"ep": 1, "sp": 1, "cp": 1, "pipeline_schedule": "1f1b", "virtual_stages": 1}
WORLD = "world"  # every rank: the default process group (no group of its own is created)


class Topology:
    """This rank's place in the grid, and the process groups of every dimension it belongs to.

    Every rank constructs its Topology; it creates only the groups of more than one rank that this rank is in,
    through `groups` (the process's `ProcessGroups`: a rank set already created is reused, so the next run in the
    same process creates nothing). With a single process and no initialized process group, all groups are None
    and all sizes are 1, so layers can run unparallelized.
    """

    def __init__(
        self,
        shape: GridShape,
        rank: int,
        pipeline_schedule: str = "1f1b",
        virtual_stages: int = 1,
        groups: ProcessGroups | None = None,
    ):
        shape.check()
        self.shape = shape
        self.rank = rank
        # which stages a pipeline rank holds (one, or DualPipeV's two)
        self.pipeline_schedule = pipeline_schedule
        self.virtual_stages = virtual_stages  # interleaved: v stages per pipeline rank
        self.coords = shape.coords(rank)
        self.process_groups = groups if groups is not None else ProcessGroups()
        self._groups: dict[str, object] = {WORLD: None}
        self._ranks: dict[str, list[int]] = {WORLD: list(range(shape.world_size))}
        initialized = dist.is_available() and dist.is_initialized()
        # NCCL serves the device channel on GPUs; CPU tensors of the same groups go through gloo (entry.py's
        # "cpu:gloo,cuda:nccl"), so the control channel needs no groups of its own.
        self.device_type = "cuda" if initialized and "nccl" in str(dist.get_backend()) else "cpu"
        self.trace: comm.CollectiveTrace | None = None
        self._handles: dict[tuple[str, str], comm.Group] = {}
        # in GROUP_AXES order on every rank: members of a group meet to create it (process_groups.py)
        for name, axes in GROUP_AXES.items():
            ranks = shape.group_of(rank, axes)
            self._ranks[name] = ranks
            if len(ranks) > 1:
                self._groups[name] = self.process_groups.get(ranks)

    @classmethod
    def from_env(
        cls,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        sp: int = 1,
        pipeline_schedule: str = "1f1b",
        virtual_stages: int = 1,
        groups: ProcessGroups | None = None,
        cp: int = 1,
    ) -> Topology:
        if dist.is_available() and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
        else:
            world, rank = 1, 0
        return cls(
            GridShape(world, tp=tp, pp=pp, ep=ep, sp=sp, cp=cp),
            rank,
            pipeline_schedule,
            virtual_stages,
            groups,
        )

    # -- generic access -------------------------------------------------------------------------------------
    def group(self, name: str):
        """torch's process group of `name`, for libraries that take one (DeepSpeed's mpu, its expert tables). A
        group of one rank is created only here, on first request: Keel's own channels of one rank are local."""
        if name not in self._groups:
            self._groups[name] = self.process_groups.get(self._ranks[name])
        return self._groups[name]

    def comm(self, name: str, channel: str) -> comm.Group:
        """The handle Keel's collectives take (keel/parallel/comm.py): group `name` through `channel`."""
        key = (name, channel)
        if key not in self._handles:
            if channel not in comm.CHANNELS:
                raise ValueError(f"unknown channel {channel!r}; one of {comm.CHANNELS}")
            self._handles[key] = self._handle(
                name, self._ranks[name], channel, self._groups.get(name)
            )
        return self._handles[key]

    def _handle(self, name: str, ranks: list[int], channel: str, group) -> comm.Group:
        return comm.Group(
            name, tuple(ranks), ranks.index(self.rank), channel, group, self.device_type, self.trace
        )

    def subgroup(self, name: str, ranks: list[int], channel: str) -> comm.Group:
        """A group of `ranks` outside the grid (this rank among them; only they call this, in the same order
        relative to their other groups): the ranks that convert a checkpoint, say."""
        ranks = sorted(ranks)
        group = self.process_groups.get(ranks) if len(ranks) > 1 else None
        return self._handle(name, ranks, channel, group)

    def trace_into(self, directory: Path) -> None:
        """Record every collective of this rank's handles in `directory` (call before handing any out)."""
        if self._handles:
            raise RuntimeError("trace_into must run before any comm handle is handed out")
        self.trace = comm.CollectiveTrace(directory, self.rank)

    def device(self, name: str) -> comm.Group:
        return self.comm(name, comm.DEVICE)

    def control(self, name: str) -> comm.Group:
        return self.comm(name, comm.CONTROL)

    def ranks(self, name: str) -> list[int]:
        return self._ranks[name]

    def size(self, name: str) -> int:
        return len(self._ranks[name])

    def rank_in(self, name: str) -> int:
        return self._ranks[name].index(self.rank)

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        return self.rank_in("dp")

    def describe(self) -> str:
        s = self.shape
        return (
            f"world={s.world_size} tp={s.tp} pp={s.pp} dp={s.dp} (ep={s.ep} edp={s.edp}) sp={s.sp}"
            + (f" cp={s.cp}" if s.cp > 1 else "")
        )

    def stamp(self) -> dict[str, int | str]:
        """What a checkpoint records of the layout that wrote it (`STAMP_DEFAULTS`: what an older one lacks)."""
        pipelined = self.shape.pp > 1
        return {
            "world_size": self.shape.world_size,
            "tp": self.shape.tp,
            "pp": self.shape.pp,
            "dp": self.shape.dp,
            "ep": self.shape.ep,
            "sp": self.shape.sp,
            "cp": self.shape.cp,
            "pipeline_schedule": self.pipeline_schedule if pipelined else "1f1b",
            "virtual_stages": self.virtual_stages
            if pipelined and self.pipeline_schedule == "interleaved"
            else 1,
        }

    # -- the mpu interface DeepSpeed queries --------------------------------------------------------------
    # DeepSpeed's "model parallel" is tensor (and Ulysses) parallel within a pipeline stage; its pipeline engine
    # builds the pipeline groups itself from its own topology object.
    def get_model_parallel_rank(self) -> int:
        return self.rank_in("tp")

    def get_model_parallel_world_size(self) -> int:
        return self.size("tp")

    def get_model_parallel_group(self):
        return self.group("tp")

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group(self):
        return self.group("dp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.rank_in("pp")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.size("pp")

    def get_pipeline_model_parallel_group(self):
        return self.group("pp")

    # DeepSpeed's "sequence parallel" ranks split a sequence and replicate the parameters: Keel's cp × sp (`seq`).
    def get_sequence_parallel_world_size(self) -> int:
        return self.size("seq")

    def get_sequence_parallel_rank(self) -> int:
        return self.rank_in("seq")

    def get_sequence_parallel_group(self):
        return self.group("seq")

    # Under sp or cp, DeepSpeed partitions ZeRO state and sums gradients over data × sequence parallel ranks.
    def get_sequence_data_parallel_world_size(self) -> int:
        return self.size("sp_dp")

    def get_sequence_data_parallel_rank(self) -> int:
        return self.rank_in("sp_dp")

    def get_sequence_data_parallel_group(self):
        return self.group("sp_dp")
