"""A deep copy of a state dict into reused host buffers that `torch.save` writes exactly as it would the original.

An asynchronous checkpoint writes the state of step N while step N+1 changes it, so the files are serialized from a
copy. The copy keeps what decides the bytes `torch.save` produces: every container's type and its attributes (a
module's state dict carries `_metadata`), one copy per storage with each tensor a view at its offset, size and
stride (tensors sharing a storage stay shared: the file holds each storage once, whole), `requires_grad`,
Parameters as Parameters, and object identity (an object referenced twice is pickled once, then by reference).

Where DeepSpeed first clones a state dict for `torch.save` (`clone_tensors_for_torch_save`: every tensor into a
compact storage of its own, so a view does not save its whole flat buffer), `clone` stands in for it and clones
straight into this snapshot's buffers; `copy` keeps those tensors where they are. So the host holds one copy of
such a file, not DeepSpeed's clone and then Keel's copy of it.

The buffers hold raw storage bytes and are kept between saves, keyed by (file, storage index): a run that saves
the same shapes every time allocates them once — the host memory is one copy of the rank's checkpoint files. On
CUDA they are pinned and filled with asynchronous copies; `wait` is the one device sync of a snapshot. (There
the files record their storages' location as "cpu" where a synchronous save records "cuda:N"; DeepSpeed loads
every checkpoint file with a CPU map_location, so nothing reads it — the bytes are otherwise the same.)
"""

from __future__ import annotations

import copy
from typing import Any

import torch

_IMMUTABLE = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


class HostSnapshot:
    def __init__(self, pin: bool):
        self.pin = pin
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._used: set[tuple[str, int]] = set()
        # data pointers of the storages `clone` filled in this snapshot
        self._cloned: set[int] = set()
        self._clones = 0  # tensors `clone` copied in this snapshot (its buffers' keys)

    def begin(self) -> None:
        """A new snapshot: buffers of files the previous one had and this one lacks are released in `wait`."""
        self._used.clear()
        self._cloned.clear()
        self._clones = 0

    def clone(self, item: Any) -> Any:
        """`item` as DeepSpeed's `clone_tensors_for_torch_save(item)` returns it — each tensor detached into a
        storage of its own on the host (strides kept where the tensor is dense, as `clone` keeps them), lists,
        tuples and dicts rebuilt, anything else as it is — with the tensors in this snapshot's buffers."""
        if isinstance(item, torch.Tensor):
            return self._clone_tensor(item)
        if isinstance(item, list):
            return [self.clone(v) for v in item]
        if isinstance(item, tuple):
            return tuple([self.clone(v) for v in item])
        if isinstance(item, dict):
            return type(item)({k: self.clone(v) for k, v in item.items()})
        return item

    def _clone_tensor(self, t: torch.Tensor) -> torch.Tensor:
        _check_plain(t)
        layout = torch.empty_like(t, device="meta")  # the strides `clone`/`to` would give it
        nbytes = layout.untyped_storage().nbytes()
        buffer = self.buffer(("<clone>", self._clones), nbytes)
        self._clones += 1
        with torch.no_grad():
            out = torch.empty(0, dtype=t.dtype).set_(
                buffer.untyped_storage(), 0, t.size(), layout.stride()
            )
            out.copy_(t.detach(), non_blocking=buffer.is_pinned())
        if nbytes:
            self._cloned.add(buffer.data_ptr())
        return out

    def holds(self, t: torch.Tensor) -> bool:
        """`t` is one of this snapshot's clones (already a host copy)."""
        storage = t.untyped_storage()
        return storage.nbytes() > 0 and storage.data_ptr() in self._cloned

    def copy(self, obj: Any, slot: str) -> Any:
        """`obj` copied; its tensors live in this snapshot's buffers for file `slot` until its next copy."""
        return _Copier(self, slot).copy(obj)

    def wait(self) -> None:
        """Every copy is complete (device copies are asynchronous); unused buffers are released."""
        for key in set(self._buffers) - self._used:
            del self._buffers[key]
        if self.pin and torch.cuda.is_available():
            torch.cuda.synchronize()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def buffer(self, key: tuple[str, int], nbytes: int) -> torch.Tensor:
        self._used.add(key)
        held = self._buffers.get(key)
        if held is None or held.numel() != nbytes:
            held = torch.empty(
                nbytes, dtype=torch.uint8, pin_memory=self.pin and torch.cuda.is_available()
            )
            self._buffers[key] = held
        return held


class _Copier:
    """One file's copy: the identity memo (object → copy) and the storage map (storage → host storage)."""

    def __init__(self, snapshot: HostSnapshot, slot: str):
        self.snapshot, self.slot = snapshot, slot
        self.memo: dict[int, Any] = {}
        self.storages: dict[
            int, tuple[torch.UntypedStorage, torch.UntypedStorage]
        ] = {}  # id → (source, host)

    def copy(self, obj: Any) -> Any:
        if isinstance(obj, _IMMUTABLE):
            return obj
        seen = self.memo.get(id(obj))
        if seen is not None:
            return seen
        if isinstance(obj, torch.Tensor):
            out = self._tensor(obj)
        elif isinstance(obj, dict):
            out = copy.copy(obj)  # same type, its attributes shared for now, same key order
            for key, value in obj.items():
                out[key] = self.copy(value)
            if getattr(obj, "__dict__", None):
                out.__dict__ = copy.deepcopy(obj.__dict__)
        elif type(obj) is list:
            out = [self.copy(v) for v in obj]
        elif isinstance(obj, tuple):
            items = [self.copy(v) for v in obj]
            out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        else:  # anything else (a NumPy RNG state, a config object): small, copied whole
            out = copy.deepcopy(obj)
        self.memo[id(obj)] = out
        return out

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if self.snapshot.holds(t):
            return t
        _check_plain(t)
        # one Python object per storage (torch keeps it for the storage's life), which torch.save keys too: an
        # empty storage shared by tied parameters is still one storage
        source = t.untyped_storage()
        held = self.storages.get(id(source))
        if held is None:
            buffer = self.snapshot.buffer((self.slot, len(self.storages)), source.nbytes())
            raw = torch.empty(0, dtype=torch.uint8, device=source.device).set_(source)
            buffer.copy_(raw, non_blocking=buffer.is_pinned())
            held = self.storages[id(source)] = (
                source,
                buffer.untyped_storage(),
            )  # `source` kept: ids stay unique
        host = held[1]
        with torch.no_grad():
            out = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        if type(t) is torch.nn.Parameter:
            out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
        elif t.requires_grad:
            out.requires_grad_(True)
        if t.__dict__:
            out.__dict__.update(copy.deepcopy(t.__dict__))
        return out


def _check_plain(t: torch.Tensor) -> None:
    if (
        type(t) not in (torch.Tensor, torch.nn.Parameter)
        or t.is_sparse
        or t.is_quantized
        or t.is_conj()
    ):
        raise TypeError(
            f"cannot snapshot a {type(t).__name__} ({t.layout}) for an asynchronous checkpoint"
        )
