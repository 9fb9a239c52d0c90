"""One process's process groups: one per distinct rank set, created by its members only, kept until teardown.

A plain `new_group` is collective over the whole world (on NCCL, with a bound device, an eager communicator split
on every rank), and a grid of 11 group kinds at 1,024 GPUs comes to thousands of them on every rank. Here:

- a rank creates only the groups it belongs to (`use_local_synchronization=True`: only the members meet, in the
  store), so what it creates is bounded by the number of group kinds, not the world;
- a rank set already created is handed out again — to another kind with the same ranks (tp_sp is tp at sp=1), to
  the next run's Topology in the same process (`run_sequence`), and to DeepSpeed's own requests (its pipeline grid,
  its world group; `keel.adapters.deepspeed_internals.serve_group_requests`);
- the whole world is the default group, never a new one; a group of one is created only when a library asks for a
  handle (DeepSpeed's model-parallel group at tp=1): Keel's own channels of one rank are local (comm.Group.active).

Members meet in the store, so two ranks that share two groups must create them in the same order, or both wait
forever: every caller walks its groups in one global order (the Topology: kinds in `GROUP_AXES` order; DeepSpeed:
its grid's order), and skipping a rank set already held is the same on every member, as all of them created it
together.

Members also meet under the group's name, which torch salts with how many groups the process holds — not the same
on every member once some created a group others are not in — so the name is made from the ranks alone
(keel/adapters/torch_internals.py). A rank set is therefore created once per process (a second creation would meet
the first one's rendezvous in the store), and one `ProcessGroups` serves the whole process: the process's entry
point makes it, passes it down, and `destroy`s it at teardown.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from keel.adapters.torch_internals import groups_named_by_their_ranks


class ProcessGroups:
    """This process's groups by rank set. Outside a process group every handle is None (one process, no peers)."""

    def __init__(self) -> None:
        self._created: dict[tuple[int, ...], Any] = {}
        self._private: dict[tuple[str, tuple[int, ...]], Any] = {}
        self._destroyed = False

    def get(self, ranks: Iterable[int]) -> Any:
        """The process group of `ranks`, created on the first request (all its members make that request, in the
        same order relative to their other groups). The default group for the whole world; torch's
        `GroupMember.NON_GROUP_MEMBER` for a set this rank is not in, without creating anything."""
        key = tuple(sorted({int(r) for r in ranks}))
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._destroyed:
            raise RuntimeError("process groups requested after teardown destroyed them")
        if key == tuple(range(dist.get_world_size())):
            return dist.group.WORLD
        if dist.get_rank() not in key:
            return dist.GroupMember.NON_GROUP_MEMBER
        if key not in self._created:
            with groups_named_by_their_ranks():  # every member names it alike (torch_internals.py)
                self._created[key] = dist.new_group(list(key), use_local_synchronization=True)
        return self._created[key]

    def private(self, ranks: Iterable[int], purpose: str) -> Any:
        """A group of `ranks` for `purpose` alone — traffic on a background thread, which must not interleave
        with the main thread's collectives on a shared group — created on the first request by its members
        only (who make it in one global order, as `get`'s callers do) and named by purpose and ranks."""
        key = tuple(sorted({int(r) for r in ranks}))
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._destroyed:
            raise RuntimeError("process groups requested after teardown destroyed them")
        if (purpose, key) not in self._private:
            with groups_named_by_their_ranks(purpose):
                self._private[purpose, key] = dist.new_group(
                    list(key), use_local_synchronization=True
                )
        return self._private[purpose, key]

    def created(self) -> list[tuple[int, ...]]:
        """The rank sets this process created, in creation order."""
        return list(self._created)

    def destroy(self) -> None:
        """Release every group created here (their threads and connections); the default group stays with the
        caller. Call once, after the last collective of this process."""
        if dist.is_available() and dist.is_initialized():
            for group in [*reversed(self._created.values()), *self._private.values()]:
                dist.destroy_process_group(group)
        self._created.clear()
        self._private.clear()
        self._destroyed = True
