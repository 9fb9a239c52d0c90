"""Fault injection, shared by tests and by users rehearsing their recovery (`faults` config section).

Every fault is applied at one well-defined point of a step so that its effect is exactly the failure it
imitates: a NaN that comes with a batch (and comes back when that batch is replayed), a loss spike, a flipped
bit in one replica's weights, NaN in a rank's weights or optimizer state (corrupt state, not bad data), a rank that
stalls, a rank whose data is garbage, a disk that fills mid-save.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from keel.adapters.deepspeed_internals import master_state, zero3_partition
from keel.config import FaultsConfig
from keel.model import Block, EmbeddingLayer
from keel.run_dir import ExitCode

log = logging.getLogger("keel")


def _fingerprint(batch: torch.Tensor) -> int:
    return hash(batch.cpu().numpy().tobytes())


class FaultInjector:
    def __init__(self, cfg: FaultsConfig, rank: int, engine, vocab_size: int, seed: int):
        """`engine`: the DeepSpeed engine (its `module` is the model)."""
        self.cfg = cfg
        self.rank = rank
        self.engine = engine
        self.model: torch.nn.Module = engine.module
        self.vocab_size = vocab_size
        self.noise = torch.Generator().manual_seed(seed + 7919 * (rank + 1))
        self.poisoned: set[int] = set()  # fingerprints of micro-batches that carry a NaN
        self.spike_steps = set(cfg.spike_steps) | ({cfg.spike_step} if cfg.spike_step else set())
        self._handle = None
        self._state_corrupted = False
        embedding = self._embedding()
        if cfg.nan_step and embedding is not None:
            self._handle = embedding.register_forward_hook(self._poison_hook)
        self.step = 0
        if cfg.outlier_step:
            for module in self.model.modules():
                if isinstance(module, Block) and module.layer_id == cfg.outlier_block:
                    module.attention.register_forward_pre_hook(self._outlier_hook)

    def _outlier_hook(self, module, args):
        """The block's normalized attention input: channel 0 × outlier_factor from outlier_step on."""
        if self.step < self.cfg.outlier_step:
            return None
        x = args[0].clone()
        x[..., 0] *= self.cfg.outlier_factor
        return (x, *args[1:])

    def _embedding(self) -> torch.nn.Module | None:
        return next((m for m in self.model.modules() if isinstance(m, EmbeddingLayer)), None)

    def _poison_hook(self, module, inputs, output):
        if _fingerprint(inputs[0]) in self.poisoned:
            output = output.clone()
            output.view(-1)[0] = float("nan")
        return output

    # -- applied by the trainer --------------------------------------------------------------------------------
    def batches(self, step: int, micro_batches: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's micro-batches for `step` (1-based), after data faults."""
        faults = self.cfg
        if faults.noise_rank == self.rank:
            micro_batches = [
                torch.randint(0, self.vocab_size, b.shape, generator=self.noise)
                for b in micro_batches
            ]
        if faults.nan_step == step and faults.nan_rank == self.rank:
            self.poisoned.add(_fingerprint(micro_batches[0][:, :-1]))
            log.warning("fault injection: NaN in rank %d's batch at step %d", self.rank, step)
        return micro_batches

    def loss_scale(self, first_sample: int, global_batch: int) -> float:
        """Factor applied to this step's loss: the batch a spike step consumes in an uninterrupted run is the
        spiking one — tied to the data, so after a rollback that moves past it the spike does not recur."""
        return (
            self.cfg.spike_factor
            if first_sample // global_batch + 1 in self.spike_steps
            and first_sample % global_batch == 0
            else 1.0
        )

    def before_forward(self, step: int) -> None:
        faults = self.cfg
        self.step = step
        if faults.pause_step == step:
            self._pause(step, Path(faults.pause_file))
        if faults.sleep_step == step and faults.sleep_rank == self.rank and faults.sleep_s > 0:
            log.warning(
                "fault injection: rank %d sleeps %.1f s at step %d", self.rank, faults.sleep_s, step
            )
            time.sleep(faults.sleep_s)

    def _pause(self, step: int, until: Path) -> None:
        """Wait here, every rank, until `until` exists; rank 0 first writes `<until>.reached`."""
        log.warning("fault injection: rank %d waits before step %d for %s", self.rank, step, until)
        if self.rank == 0:
            until.with_name(until.name + ".reached").write_text(f"{step}\n")
        while not until.exists():
            time.sleep(0.02)

    def during_save(self, step: int) -> None:
        """Inside the checkpoint save at `step`, after this rank wrote its files and before the others wait for it
        (an asynchronous save: in the writer thread, before its files are renamed into place)."""
        faults = self.cfg
        if (
            faults.save_stall_rank == self.rank
            and faults.save_stall_s > 0
            and faults.save_stall_step in (0, step)
        ):
            log.warning(
                "fault injection: rank %d stalls %.1f s inside a checkpoint save",
                self.rank,
                faults.save_stall_s,
            )
            time.sleep(faults.save_stall_s)

    def disk_room(self, step: int) -> int | None:
        """Bytes this rank's disk takes in the checkpoint save at `step` before failing with ENOSPC (applied inside
        DeepSpeed's own shard write, keel/training/checkpoint/writes.py); None: the disk is fine."""
        faults = self.cfg
        if faults.save_enospc_rank == self.rank and faults.save_enospc_step in (0, step):
            return faults.save_enospc_bytes
        return None

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        self._corrupt_state(step)
        faults = self.cfg
        if faults.crash_step == step:
            log.error("fault injection: rank %d crashes after step %d", self.rank, step)
            logging.shutdown()
            os._exit(ExitCode.FAILED)
        if faults.bitflip_step != step or faults.bitflip_rank != self.rank:
            return
        named = dict(self.model.named_parameters())
        name = faults.bitflip_param or next(
            n for n, p in named.items() if master_state(self.engine, p)
        )
        held = master_state(self.engine, named[name])
        if not held:
            raise ValueError(
                f"faults.bitflip_param={name}: rank {self.rank} holds no part of it under this "
                "ZeRO partitioning; name a parameter in its partition"
            )
        # The truth the next steps are rebuilt from: the parameter (ZeRO-0) or this rank's fp32 partition.
        state = "param" if "param" in held else "fp32"
        target = held[state].view(-1)
        bits = target.view(torch.int32) if target.element_size() == 4 else target.view(torch.int16)
        # A low mantissa bit of the first element (bit 4 of fp32's 23, bit 0 of a 16-bit type): a change of a few
        # ulp, the hard case for a check, yet one the next updates' rounding does not wash out (bit 0 of fp32 can be).
        bits[0] ^= 1 << (4 if target.element_size() == 4 else 0)
        log.warning(
            "fault injection: flipped a low mantissa bit of %s (%s) on rank %d after step %d",
            name,
            state,
            self.rank,
            step,
        )

    @torch.no_grad()
    def _corrupt_state(self, step: int) -> None:
        """NaN into this rank's share of one state tensor of the first parameter it holds, once per process: a
        rollback that replays the step finds it sound (an upset, not a defect that comes back)."""
        faults = self.cfg
        if (
            self._state_corrupted
            or faults.corrupt_state_step != step
            or faults.corrupt_state_rank != self.rank
        ):
            return
        self._state_corrupted = True
        name, param = next(
            (n, p) for n, p in self.model.named_parameters() if master_state(self.engine, p)
        )
        held = master_state(self.engine, param)
        # written through the per-parameter views (DeepSpeed's fragment mapping, or the parameter itself), not
        # through the optimizer's flat tensors the state check reads
        targets = {
            "exp_avg_sq": held.get("exp_avg_sq"),
            "master": held.get("fp32", held.get("param")),
            "param": zero3_partition(param).data,
        }
        target = targets[faults.corrupt_state_what]
        if target is None:
            raise ValueError(
                f"faults.corrupt_state_what={faults.corrupt_state_what}: rank {self.rank}'s optimizer "
                f"holds no such state for {name}"
            )
        target.fill_(float("nan"))
        log.warning(
            "fault injection: NaN in %s of %s on rank %d after step %d",
            faults.corrupt_state_what,
            name,
            self.rank,
            step,
        )
