"""The training loop's control path in a simulated world (keel/engine/simulated_world.py).

One step's collectives and each periodic check's, driven the way the trainer drives them, with
small tensors and no engine, after the rank's construction (`construct`,
keel/engine/simulated_construction.py).

What a step sends besides DeepSpeed's own gradient traffic: the loss reduction the guards decide on
(the dp mean; under pp > 1 `Trainer._pipeline_losses`) and the step's agreement beside it on the
device channel (`step_gate.post_agreement`); while an async save is pending, its poll
(`AsyncCheckpointer.poll`). The
periodic checks: the loss-outlier gather, the replica checksums
(keel/training/guards/consistency.py) and the straggler monitor (keel/training/observe/watchdog.py).
Each is Keel's own code, called with stand-ins only for what the fake backend cannot supply (an
engine at its step, a writer thread), so a change to how they communicate shows here without
touching this file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace

import torch
from torch import nn

from keel.config import RunConfig
from keel.engine.scale_report import shape_label
from keel.engine.simulated_construction import construct, small_config, unique_parameters
from keel.engine.simulated_world import (
    ASYNC_SAVE_STEP,
    CHECK,
    STEP,
    SimulatedWorld,
    WorldRecord,
    deep_size,
)
from keel.parallel.topology import WORLD, GridShape, Topology
from keel.training.checkpoint.async_save import AsyncCheckpointer
from keel.training.guards.base import Decision
from keel.training.guards.consistency import ChecksumCheck, Checksummer, LossOutlierCheck
from keel.training.observe.watchdog import StragglerMonitor
from keel.training.step_gate import post_agreement
from keel.training.trainer import Trainer, _device_mean

Driver = Callable[[SimulatedWorld, Topology], object]


def simulate(
    shape: GridShape,
    rank: int,
    cfg: RunConfig | None = None,
    engine: str = "meta",
    also: Mapping[str, Driver] | None = None,
    ds: dict | None = None,
) -> WorldRecord:
    """Rank `rank` of a world of `shape`: construction (`construct`: Topology, meta layers,
    DeepSpeed as far as it goes; `engine` as there), one step, one step with an async save pending,
    and each periodic check; then each of `also` (phase name → driver, e.g. preflight's exchange
    from keel/tools/preflight/simulated.py, which this layer cannot import) in its own phase. `ds`:
    the DeepSpeed JSON (default ds_configs/zero1.json's). Returns what the rank created, sent and kept."""
    cfg = cfg or small_config(shape)
    with SimulatedWorld(shape.world_size, rank) as world:
        world.record.label = shape_label(shape)
        built = construct(world, shape, cfg, engine, ds)
        drive_step(world, built.topology, pipelined=cfg.parallel.pp > 1)
        drive_async_save_poll(world, built.topology)
        drive_checks(world, built.topology, built.layers)
        for phase, driver in (also or {}).items():
            with world.phase(phase):
                driver(world, built.topology)
    return world.record


class _PipelineAtStep:
    """What `Trainer._pipeline_losses` reads of DeepSpeed's pipeline engine inside its step."""

    device = torch.device("cpu")

    def __init__(self, last_stage: bool):
        self.last_stage = last_stage
        self.total_loss = torch.tensor(1.0)

    def is_last_stage(self) -> bool:
        return self.last_stage

    def gradient_accumulation_steps(self) -> int:
        return 1


def drive_step(world: SimulatedWorld, topology: Topology, pipelined: bool) -> None:
    """One optimizer step's Keel collectives, in the trainer's order: the loss the guards read and
    the step's agreement, posted together on the device channel and read back at once."""
    with world.phase(STEP):
        if pipelined:
            last = topology.rank_in("pp") == topology.size("pp") - 1
            Trainer._pipeline_losses(
                SimpleNamespace(
                    engine=_PipelineAtStep(last),
                    topology=topology,
                    dp_group=topology.device("dp"),
                )
            )
        else:
            _device_mean(torch.ones(()), topology.device("dp"))
        post_agreement(Decision(), False, False, topology.device(WORLD), "cpu")


def drive_async_save_poll(world: SimulatedWorld, topology: Topology) -> None:
    """What a step adds while an async save is being written: this rank's writer state rides on the step's
    agreement (`StepGate`), and `AsyncCheckpointer.poll` concludes from the agreed tag (on the fake backend no
    rank's writer finishes, so none is agreed)."""
    pending = SimpleNamespace(tag="step00000100", writer=SimpleNamespace(is_alive=lambda: True))
    saver = SimpleNamespace(pending=pending, control=topology.control(WORLD), concluded=[])
    with world.phase(ASYNC_SAVE_STEP):
        AsyncCheckpointer.writing(saver)
        AsyncCheckpointer.poll(saver, written=None)


def stand_in_parameters(layers: list[nn.Module]) -> nn.ParameterList:
    """One-element CPU parameters with the attributes of this rank's meta parameters (DeepSpeed's
    MoE and tensor-parallel marks): the checksum check sends one value per parameter, whatever its
    size."""
    stand_ins = nn.ParameterList()
    for param in unique_parameters(layers):
        stand_in = nn.Parameter(torch.zeros(1), requires_grad=param.requires_grad)
        stand_in.__dict__.update(param.__dict__)
        stand_ins.append(stand_in)
    return stand_ins


def drive_checks(
    world: SimulatedWorld, topology: Topology, layers: list[nn.Module], zero_stage: int = 1
) -> None:
    """Each periodic check once, in a phase of its own ("check:<name>"); the straggler monitor's
    first check runs before its counted one (on cbd7c25 it gathered every host name once per run)."""
    with world.phase(CHECK + LossOutlierCheck.name):
        LossOutlierCheck(topology, sigmas=3.0, repeats=3).check(1.0)
    with world.phase(CHECK + ChecksumCheck.name):
        ChecksumCheck(stand_in_parameters(layers), topology, zero_stage, Checksummer()).check()
    stragglers = StragglerMonitor(topology.control(WORLD), interval=1)
    with world.phase("stragglers, first check"):
        stragglers.update(1, 1.0)
    with world.phase(CHECK + "stragglers"):
        report = stragglers.update(2, 1.0)
        if report is not None:
            for key, value in report.metrics.items():
                if isinstance(value, list):
                    world.hold(f"metrics record {key!r}", len(value), deep_size(value))
