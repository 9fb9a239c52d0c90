"""Preflight's exchange between ranks in a simulated world (keel/engine/simulated_world.py).

`run_preflight` (run.py) measures, gathers every rank's `RankRecord` to rank 0 and broadcasts its
verdict. `exchange` runs the same communication in the same order — clock offsets, the timed
collectives of every group kind and link (with the pair groups they create), the records' gather,
the verdict — on one rank of a simulated world. What touches hardware (compute, storage, memory) is
replaced by fixed stand-in results: their records are small and the same at any world size, unlike
the timings, which name every rank of the groups they timed.

Pass it to `keel.training.simulated_steps.simulate(..., also={"preflight": exchange})`.
"""

from __future__ import annotations

import pickle

from keel.engine.simulated_world import SimulatedWorld, deep_size
from keel.parallel import comm
from keel.parallel.topology import WORLD, Topology
from keel.tools.preflight.clock import Clock, measure_offsets
from keel.tools.preflight.collectives import Injected, Timer, measure_kinds, measure_links
from keel.tools.preflight.compute import ComputeResult
from keel.tools.preflight.judge import RankRecord
from keel.tools.preflight.memory import MemoryResult
from keel.tools.preflight.storage import StorageResult

HOST = "simulated"


def exchange(world: SimulatedWorld, topology: Topology) -> list[RankRecord]:
    """Every collective `run_preflight` issues, in its order. Returns the records gathered to rank 0
    (this rank's own in every slot, as the fake backend gives; none on other ranks); notes on
    `world` what rank 0 keeps."""
    control = topology.control(WORLD)
    clock = Clock()
    comm.barrier(control)
    offsets = measure_offsets(clock, control)
    own = offsets[topology.rank].offset_s
    timer = Timer(lambda: clock.now() - own, topology.rank, Injected(), topology.device_type)
    timings = measure_kinds(topology, timer) + measure_links(topology, timer)
    comm.barrier(control)  # around the compute measurement
    comm.barrier(control)
    record = RankRecord(
        topology.rank,
        HOST,
        ComputeResult("cpu", "0" * 64, 0.0, 0.0, "fp32"),
        StorageResult("/", 0.0, 0.0, True, 0),
        MemoryResult(HOST, 0, -1),
        timings,
    )
    records = comm.gather_object(record, control)
    if records is not None:  # rank 0, which judges
        unpickled = deep_size(pickle.loads(pickle.dumps(record)))  # one received record
        world.hold("every rank's preflight record", len(records), len(records) * unpickled)
    comm.broadcast_object(0, control)
    return records or []
