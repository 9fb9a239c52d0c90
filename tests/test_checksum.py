"""Parameter checksums: every single flipped bit changes them, and their temporary memory does not grow with the
tensor (guards/consistency.py `Checksummer`)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from keel.training.guards.consistency import CHUNK_WORDS, Checksummer, checksum


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8]
)
@pytest.mark.parametrize("chunk_words", [4, CHUNK_WORDS])
def test_every_single_bit_flip_changes_the_checksum(dtype, chunk_words):
    """Every bit of every element of a small tensor, over several chunks (chunk_words=4) and one; the random bits
    include large words, so the int64 sums wrap around."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(
        0,
        256,
        (24 * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=gen,
    )
    tensor = raw.view(dtype)
    summer = Checksummer(chunk_words)
    clean = int(summer.checksum(tensor))
    assert clean == int(summer.checksum(tensor.clone()))
    for byte in range(raw.numel()):
        for bit in range(8):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            assert int(summer.checksum(flipped.view(dtype))) != clean, (byte, bit)


def test_swapped_elements_change_the_checksum():
    x = torch.arange(10, dtype=torch.float32)
    y = x.clone()
    y[[2, 7]] = y[[7, 2]]
    assert checksum(x) != checksum(y)


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor storage any op creates (views of an input are not new memory)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_checksum_temporaries_do_not_grow_with_the_tensor(dtype=torch.float32):
    """1M and 16M elements: the same largest temporary, a few MiB (a whole-tensor int64 copy would be 128 MiB)."""
    largest = []
    for numel in (1 << 20, 1 << 24):
        tensor = torch.ones(numel, dtype=dtype)
        with LargestAllocation() as mode:
            Checksummer().checksum(tensor)
        largest.append(mode.largest)
    assert largest[0] == largest[1] <= 4 * CHUNK_WORDS * 8 // 2, largest  # ≤ 4 MiB
    assert largest[0] >= CHUNK_WORDS * 8  # the mode does see the chunk-sized int64 buffers
