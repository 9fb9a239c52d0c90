"""Corruption at rest: each rank checks its own share of the truth, which no replica can vouch for.

Under ZeRO-1/2/3 the fp32 master weights and the optimizer state exist once, partitioned across data-parallel
ranks, and every step rebuilds the working weights from them — so replicas always agree, and a bit flip in a
partition spreads to every rank unseen by any cross-replica comparison. Instead each rank seals (checksums) its
own state right after the update of the step before a check and verifies it before the check step's update: any
change in between is corruption. At ZeRO-0 the same covers the parameters and the Adam moments.

Covers the window between those two points (one step in every `checksum_interval`); a flip during the update
itself, or in the steps between checks, is not seen here (see docs/stability.md).
"""

from __future__ import annotations

import torch

from keel.adapters.deepspeed_internals import master_state
from keel.training.guards.consistency import Checksummer


class AtRestCheck:
    """Seal after an update, verify before the next one; local (no collective): `take` hands the flags to the
    check that agrees them (ChecksumCheck)."""

    def __init__(self, engine, checksummer: Checksummer):
        self.engine = engine
        self.named = list(engine.module.named_parameters())
        self.checksummer = checksummer
        self.device = next(engine.module.parameters()).device
        self._sealed: tuple[int, list[tuple[str, str]], torch.Tensor] | None = None
        self._changed: tuple[list[tuple[str, str]], torch.Tensor] | None = None

    def _entries(self) -> tuple[list[tuple[str, str]], list[torch.Tensor]]:
        keys, tensors = [], []
        for name, param in self.named:
            for state, tensor in master_state(self.engine, param).items():
                keys.append((name, state))
                tensors.append(tensor)
        return keys, tensors

    def seal(self) -> None:
        keys, tensors = self._entries()
        self._sealed = (self.engine.global_steps, keys, self.checksummer.sums(tensors, self.device))

    def verify(self) -> None:
        """Compare with the seal (device-side, no host sync); a reload since the seal (another step count) or a
        change in what is held (optimizer state created) makes the seal void instead."""
        sealed, self._sealed = self._sealed, None
        if sealed is None:
            return
        steps, keys, sums = sealed
        if steps != self.engine.global_steps:
            return
        now_keys, tensors = self._entries()
        if now_keys == keys:
            self._changed = (keys, self.checksummer.sums(tensors, self.device) != sums)

    def take(self) -> tuple[list[tuple[str, str]], torch.Tensor] | None:
        """(entries, changed flags on the device) from the last `verify`, once; None when nothing was verified."""
        changed, self._changed = self._changed, None
        return changed

    def forget(self) -> None:
        """State was reloaded: any seal is void."""
        self._sealed = self._changed = None
