"""What a layer knows of parallelism: one object holding the context of every axis that shards a layer.

The model's layers and builders take one `LayerParallel` (`parallel=`), built once per rank from the Topology,
and each layer hands its primitives the axis they need (`parallel.tp` to the tensor-parallel linears,
`parallel.sp` to Ulysses, `parallel.ep` to the expert all-to-alls). A new axis is a field here and in
`from_topology`; the layers that use it read it, and no signature in between changes. A layer that is not
parallel takes none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from keel.parallel.context import CPContext
from keel.parallel.experts import EPContext
from keel.parallel.tensor import TPContext
from keel.parallel.ulysses import SPContext, sequence_chunk


@dataclass(frozen=True)
class LayerParallel:
    """Tensor (with Megatron sequence parallelism), Ulysses sequence, context and expert parallelism of one rank's
    layers. `seq` is every rank splitting one sequence (cp × sp): the loss's mean, the router's token counts and
    FP8's token scales reduce over it.

    Each field defaults to "not parallel" (size 1, no group), so `LayerParallel()` is a single process.
    """

    tp: TPContext = field(default_factory=TPContext)
    sp: SPContext = field(default_factory=SPContext)
    ep: EPContext = field(default_factory=EPContext)
    cp: CPContext = field(default_factory=CPContext)
    seq: SPContext = field(default_factory=SPContext)

    def sequence_shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a [b, s, ...] tensor every rank of the sequence holds whole (token ids, labels):
        its two context-parallel chunks, then its Ulysses piece of them."""
        return sequence_chunk(self.cp.local(x), self.sp)

    @classmethod
    def from_topology(
        cls, topology, sequence_parallel: bool = False, seed: int = 0
    ) -> LayerParallel:
        """This rank's contexts from the Topology's groups (none parallel when `topology` is None).
        `sequence_parallel`: Megatron SP inside the tp group; `seed`: the run's, for SP's dropout stream."""
        return cls(
            tp=TPContext.from_topology(topology, sequence_parallel, seed=seed),
            ep=EPContext.from_topology(topology),
            sp=SPContext.from_topology(topology),
            cp=CPContext.from_topology(topology),
            seq=SPContext.from_topology(topology, "seq"),
        )

    @classmethod
    def without_groups(
        cls, tp: int = 1, ep: int = 1, tp_rank: int = 0, ep_rank: int = 0
    ) -> LayerParallel:
        """One rank of a tp × ep layout with no process groups: its layers hold exactly that rank's shards and
        experts, to be counted, initialised or converted in one process (the memory model and pipeline plan count
        rank 0 on meta before launch), but a forward that communicates cannot run."""
        return cls(
            tp=TPContext(rank=tp_rank, size=tp),
            ep=EPContext(rank=ep_rank, size=ep, ranks=tuple(range(ep))),
        )


# a single process: the layers' default (frozen, so one shared instance is safe)
NO_PARALLEL = LayerParallel()
