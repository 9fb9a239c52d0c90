"""Deterministic initialisation of one rank's shard, drawn in fixed row blocks of the logical tensor.

A logical tensor (the unpadded, unsharded weight, e.g. `attention.wq.weight` of block 3) is cut into row blocks
of `block_rows(full_shape)` rows — a function of the logical shape alone, so it is the same at every tp size.
Block b draws from a generator keyed by (seed, layer index, logical name, b), never by the order parameters are
visited, so a shard draws exactly the blocks it holds rows of (column-parallel) or every block at full width and
keeps its columns (row-parallel). The temporary is one block, at most `INIT_BLOCK_BYTES` (or one full-width row
when a row alone is larger), whatever the tensor's size; every tp/pp/ep layout gets exactly the tp = 1 values.

A fused projection (k/v, gate/up: logical [parts, out, in], keel/parallel/tensor.py) is drawn part by part,
each part as the separate [out, in] tensor it fuses under that projection's own name (`feed_forward.w1.weight`),
so fusing changes no weight: a seed gives the same model as before the fusion, at every tp.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from keel.adapters.deepspeed_internals import logical_shape
from keel.config import ModelConfig

# Bound of the fp32 block one draw allocates (the "init buffer"); a row wider than this is drawn alone.
INIT_BLOCK_BYTES = 4 * 2**20


def block_rows(full_shape: tuple[int, ...]) -> int:
    """Rows per block of a logical tensor: as many full-width fp32 rows as fit in `INIT_BLOCK_BYTES` (≥ 1)."""
    width = math.prod(full_shape[1:])
    return max(1, INIT_BLOCK_BYTES // (4 * max(width, 1)))


def block_generator(seed: int, index: int, name: str, block: int) -> torch.Generator:
    """The stream of one block, keyed by (seed, layer index, logical name, block index).

    The CPU generator keeps 32 bits of its seed; the key's hash is reduced explicitly so the rule is visible.
    """
    digest = hashlib.sha256(f"{seed}/{index}/{name}/{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))


def _draw(
    rows: int, width: int, std: float, truncated: bool, generator: torch.Generator
) -> torch.Tensor:
    values = torch.empty(rows, width, dtype=torch.float32)
    if truncated:
        nn.init.trunc_normal_(values, 0.0, std, -3.0 * std, 3.0 * std, generator=generator)
    else:
        values.normal_(0.0, std, generator=generator)
    return values


def fill_rows_(
    out: torch.Tensor,
    full_shape: tuple[int, ...],
    rows: tuple[int, int],
    cols: tuple[int, int],
    std: float,
    truncated: bool,
    seed: int,
    index: int,
    name: str,
) -> None:
    """Fill `out` [rows, cols] (flattened trailing dims) with the logical tensor's window `rows` × `cols`.

    Positions past the logical tensor (vocabulary padding) are zero. Values are drawn in fp32 on the CPU, one
    block at a time, so they are the same whatever `out`'s device or dtype.
    """
    total_rows, width = full_shape[0], math.prod(full_shape[1:])
    out = out.view(out.shape[0], -1)
    out.zero_()
    first, last = rows[0], min(rows[1], total_rows)
    col_end = min(cols[1], width)
    if first >= last or cols[0] >= col_end:
        return
    per_block = block_rows(full_shape)
    for block in range(first // per_block, (last - 1) // per_block + 1):
        start = block * per_block
        stop = min(start + per_block, total_rows)
        values = _draw(
            stop - start, width, std, truncated, block_generator(seed, index, name, block)
        )
        lo, hi = max(start, first), min(stop, last)
        out[lo - first : hi - first, : col_end - cols[0]].copy_(
            values[lo - start : hi - start, cols[0] : col_end]
        )


def fill_shard_(
    param: torch.Tensor,
    std: float | tuple[float, ...],
    truncated: bool,
    seed: int,
    index: int,
    name: str | tuple[str, ...],
    out: torch.Tensor | None = None,
    flat: tuple[int, int] | None = None,
) -> None:
    """Fill this rank's shard of a parameter marked by `mark_sharded` (or a whole unmarked parameter).

    With `flat` = (start, end), `out` is only that window of the flattened shard (a ZeRO-3 partition): it is
    filled a chunk of at most `INIT_BLOCK_BYTES` of rows at a time, so no whole shard is ever built.

    A tuple of names is a fused parameter whose logical dim 0 indexes its parts (sharded on a later dim): part i
    is drawn as its own logical tensor, named `name[i]`, with std `std[i]` when `std` is a tuple. Each part's shard
    is one contiguous stretch of the flattened shard, so a flat window is cut into the parts it overlaps.
    """
    shape = tuple(logical_shape(param))
    full_shape = tuple(getattr(param, "full_shape", shape))
    dim = getattr(param, "partition_dim", None)
    rank = getattr(param, "tp_rank", 0)
    if isinstance(name, str):
        if isinstance(std, tuple):
            raise ValueError(f"one std per part ({std}) for the unfused parameter {name}")
        _fill_part(
            param.data if out is None else out,
            shape,
            full_shape,
            dim,
            rank,
            flat,
            std,
            truncated,
            seed,
            index,
            name,
        )
        return
    if full_shape[0] != len(name) or dim == 0:
        raise ValueError(
            f"a fused parameter of logical shape {full_shape} (split on dim {dim}) has no {len(name)} "
            "parts on dim 0"
        )
    part_numel = math.prod(shape[1:])
    part_dim = None if dim is None else dim - 1
    stds = std if isinstance(std, tuple) else (std,) * len(name)
    if len(stds) != len(name):
        raise ValueError(f"{len(stds)} stds for the {len(name)} parts {name}")
    for part, (part_name, part_std) in enumerate(zip(name, stds)):
        lo, hi = part * part_numel, (part + 1) * part_numel
        if flat is None:
            target, window = (param.data if out is None else out)[part], None
        else:
            lo, hi = max(lo, flat[0]), min(hi, flat[1])
            if lo >= hi:
                continue
            target, window = (
                out[lo - flat[0] : hi - flat[0]],
                (lo - part * part_numel, hi - part * part_numel),
            )
        _fill_part(
            target,
            shape[1:],
            full_shape[1:],
            part_dim,
            rank,
            window,
            part_std,
            truncated,
            seed,
            index,
            part_name,
        )


def _fill_part(
    out: torch.Tensor,
    shape: tuple[int, ...],
    full_shape: tuple[int, ...],
    dim: int | None,
    rank: int,
    flat: tuple[int, int] | None,
    std: float,
    truncated: bool,
    seed: int,
    index: int,
    name: str,
) -> None:
    """`fill_shard_` for one logical tensor: `shape` is the shard's, cut from `full_shape` on `dim` at `rank`."""
    local_rows, local_cols = shape[0], math.prod(shape[1:])
    rows = (rank * local_rows, (rank + 1) * local_rows) if dim == 0 else (0, local_rows)
    cols = (rank * local_cols, (rank + 1) * local_cols) if dim == 1 else (0, local_cols)
    if flat is None:
        fill_rows_(out, full_shape, rows, cols, std, truncated, seed, index, name)
        return
    start, end = flat
    chunk = max(1, INIT_BLOCK_BYTES // (4 * local_cols))
    for first in range(start // local_cols, -(-end // local_cols), chunk):
        last = min(first + chunk, local_rows)
        values = torch.empty(last - first, local_cols, dtype=torch.float32)
        fill_rows_(
            values,
            full_shape,
            (rows[0] + first, rows[0] + last),
            cols,
            std,
            truncated,
            seed,
            index,
            name,
        )
        lo, hi = max(start, first * local_cols), min(end, last * local_cols)
        out[lo - start : hi - start].copy_(
            values.view(-1)[lo - first * local_cols : hi - first * local_cols]
        )


# -- which std each matrix gets ----------------------------------------------------------------------------
# Parameters on the residual branch's output; initialised with std / sqrt(2·n_layers) (GPT-2, Megatron): the
# attention output and every MLP's down projection (dense, each expert's, the shared expert's).
_RESIDUAL_OUTPUTS = (".wo.weight", ".w2.weight")


def deepnorm_alpha(cfg: ModelConfig) -> float:
    """DeepNet's residual scale for a decoder-only model of N layers: α = (2N)^¼ (Wang et al. 2022, table 1)."""
    return (2 * cfg.n_layers) ** 0.25


def deepnorm_beta(cfg: ModelConfig) -> float:
    """DeepNet's init gain for the value, attention-output and MLP projections: β = (8N)^-¼ (table 1)."""
    return (8 * cfg.n_layers) ** -0.25


# DeepNet scales these by β: the value projection (part 1 of the fused wkv), attention output, every MLP matrix
_DEEPNORM_SCALED = (".wo.weight", ".w2.weight", ".w13.weight")


def base_init_std(cfg: ModelConfig) -> float:
    """The matrices' std: `model.init_std`, or small-init's sqrt(2 / (5·dim)) (Nguyen & Salazar 2019)."""
    return math.sqrt(2 / (5 * cfg.dim)) if cfg.init == "small_init" else cfg.init_std


def matrix_init_std(name: str, cfg: ModelConfig) -> float | tuple[float, ...]:
    """The std of a block's matrix `name` (a tuple: one per part of a fused projection).

    Residual-branch outputs (`wo`, `w2`) get std / sqrt(2·n_layers) (GPT-2, Megatron); under DeepNet the value,
    attention-output and MLP matrices get std·β instead, and q and k keep std."""
    std = base_init_std(cfg)
    if cfg.deepnorm:
        beta = std * deepnorm_beta(cfg)
        if name.endswith(".wkv.weight"):
            return std, beta  # (k, v)
        return beta if name.endswith(_DEEPNORM_SCALED) else std
    return std / math.sqrt(2 * cfg.n_layers) if name.endswith(_RESIDUAL_OUTPUTS) else std
