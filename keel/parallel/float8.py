"""FP8 and MX GEMMs for Keel's linears, each scale taken over the whole logical tensor it covers.

A dynamically scaled cast divides a tensor by the amax of the values one scale covers: all of it (tensorwise) or
one row along an axis (rowwise). When a linear is tensor-parallel or runs on a Ulysses sequence chunk, some of
those values live on other ranks — a column-parallel weight's output rows, a row-parallel input's hidden
columns, a chunk's tokens — and a scale from the local shard alone would make tp=2 FP8 a different model from
tp=1 FP8. So each cast here reduces its amax (MAX) over the groups that split the axes its scale covers, and every
rank casts with the scale one process would use. Each GEMM's axes are named m (tokens), k (its input features)
and n (its output features); a linear says which group splits which (`Float8Spec.tokens` the m axis, tp the k
axis of a row-parallel and the n axis of a column-parallel linear).

The recipes, casts and GEMMs (emulated, or `torch._scaled_mm` on an FP8 GPU) are torchao's
(keel/adapters/torchao_internals.py); this module is the distributed amax, which torchao's module swap cannot
give linears that are not `nn.Linear`s sharded by DTensor. The MX formats scale blocks of 32 along each GEMM's
reduction axis; a block never spans ranks when each shard's extent is a multiple of 32
(keel.config.validate_mx_blocks), so they need no reduction at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from keel.adapters import torchao_internals as ao
from keel.parallel import comm

_TORCHAO_RECIPE = {
    "tensorwise": "tensorwise",
    "rowwise": "rowwise",
    "rowwise_gw_hp": "rowwise_with_gw_hp",
}


@dataclass(frozen=True)
class _Ops:
    """The torchao pieces one recipe's casts use, resolved once: under torch.compile the forward and backward
    are traced, and a lookup there (a cache, a lazy import) would break the graph at every linear."""

    config: Any  # Float8LinearConfig
    mm: Any  # LinearMMConfig
    tensor_to_amax: Any
    amax_to_scale: Any
    to_float8: Any  # hp_tensor_and_scale_to_float8
    disabled: Any  # ScalingType.DISABLED
    tensorwise: Any  # ScalingGranularity.TENSORWISE
    role: Any  # GemmInputRole


@functools.cache  # immutable: one per recipe and mode
def _ops(recipe: str, emulate: bool) -> _Ops:
    config = ao.linear_config(_TORCHAO_RECIPE[recipe], emulate)
    return _Ops(
        config,
        ao.mm_config(config),
        ao.get("tensor_to_amax"),
        ao.get("amax_to_scale"),
        ao.get("hp_tensor_and_scale_to_float8"),
        ao.get("ScalingType").DISABLED,
        ao.get("ScalingGranularity").TENSORWISE,
        ao.get("GemmInputRole"),
    )


@dataclass(frozen=True, eq=False)
class Float8Spec:
    """How one layer's linears compute: the recipe, emulated or on FP8 hardware, and the group (if any) that
    splits its tokens (Ulysses sp: the linears see this rank's sequence chunk)."""

    recipe: str
    emulate: bool = True
    tokens: comm.Group | None = None
    # resolved when the layers are built, not at the first forward, which may be inside torch.compile's tracing
    # (where importing torchao fails)
    ops: _Ops | None = field(init=False, default=None)
    mx_matmul: Any = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.is_mx:
            object.__setattr__(self, "mx_matmul", ao.mx_matmul_function())
        else:
            object.__setattr__(self, "ops", _ops(self.recipe, self.emulate))

    @property
    def is_mx(self) -> bool:
        return self.recipe.startswith("mx")

    def torchao_config(self):
        """(Float8LinearConfig, LinearMMConfig) of an FP8 recipe."""
        return self.ops.config, self.ops.mm


def emulated(device: torch.device | str, recipe: str) -> bool:
    """Whether `recipe` must be emulated on `device`: FP8 GEMMs need compute capability 8.9 (Ada, Hopper), the MX
    formats 10.0 (Blackwell); a CPU always emulates (same numerics, no speed)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    need = (10, 0) if recipe.startswith("mx") else (8, 9)
    return torch.cuda.get_device_capability(device) < need


# the rows of a probe: the operands each GEMM casts (input activations, weights, output gradients), and its
# columns: the fraction of an operand's values clipped at the format's largest magnitude (saturated), and the
# fraction of its non-zero values that fall below the format's normal range (underflow: kept with fewer mantissa
# bits or flushed to zero — an outlier stretched the scale, or the values are too small for it)
PROBE_ROLES = ("x", "w", "g")
PROBE_STATS = ("saturated", "underflow")


def new_probe(device: torch.device | str) -> torch.Tensor:
    """A linear's probe: [role, stat], each the largest fraction seen while it is set (on device, no sync)."""
    return torch.zeros(len(PROBE_ROLES), len(PROBE_STATS), device=device)


@torch.no_grad()
def _record(
    probe: torch.Tensor,
    role: int,
    t: torch.Tensor,
    scaled: torch.Tensor,
    dtype: torch.dtype | None,
    smallest_normal: float = 0.0,
) -> None:
    """Fold one cast's fractions into `probe[role]`: `t` in high precision, `scaled` = t × its scale, before the
    cast to the FP8 `dtype` (None: an MX element format, whose scales never clip, normal from `smallest_normal`)."""
    nonzero = t != 0
    magnitude = scaled.abs()
    if dtype is not None:
        finfo = torch.finfo(dtype)
        smallest_normal = finfo.smallest_normal
        # clipped by more than rounding (the amax itself lands on max only up to fp32 rounding of its scale)
        saturated = (magnitude > finfo.max * (1 + finfo.eps / 2)).float().mean()
    else:
        saturated = torch.zeros((), device=t.device)
    # below the normal range: kept with fewer mantissa bits, or flushed to zero
    lost = magnitude < smallest_normal
    underflow = (lost & nonzero).float().sum() / nonzero.sum().clamp(min=1)
    torch.maximum(probe[role], torch.stack([saturated, underflow]), out=probe[role])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    spec: Float8Spec,
    k: comm.Group | None = None,
    n: comm.Group | None = None,
    probe: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weightᵀ (weight [n, k]) in `spec`'s recipe; `k`/`n`: the groups splitting the input/output features;
    `probe`: where to record the casts' saturation and underflow (`new_probe`), on the monitor's steps."""
    if spec.is_mx:
        element = torch.float8_e4m3fn if spec.recipe == "mxfp8" else torch.float4_e2m1fn_x2
        if probe is not None:
            _probe_mx(probe, x, weight, element)
        return spec.mx_matmul(x, weight, element, spec.emulate)
    groups = {"m": spec.tokens, "k": k, "n": n}
    groups = {a: g for a, g in groups.items() if g is not None}
    return _Float8MatMul.apply(x, weight.t(), spec, groups, probe)


# the MX element formats: (largest magnitude, smallest normal magnitude)
_MX_ELEMENTS = {torch.float8_e4m3fn: (448.0, 2.0**-6), torch.float4_e2m1fn_x2: (6.0, 1.0)}


@torch.no_grad()
def _probe_mx(probe: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, element) -> None:
    """The MX GEMMs cast inside torchao's autograd function, so the probe scales the forward operands itself, as
    torchao's RCEIL mode does: each block of 32 along the reduction axis by the power of two that brings its amax
    to at most the element format's maximum (monitor steps only). Rounding the scale up means nothing clips; the
    values below the element format's normal range are what it shows. Gradients are not probed on this path."""
    top, smallest_normal = _MX_ELEMENTS[element]
    for role, t in ((0, x), (1, weight)):
        blocks = t.detach().float().reshape(-1, 32)
        amax = blocks.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        scale = torch.exp2(torch.ceil(torch.log2(amax / top)))
        _record(probe, role, blocks, blocks / scale, None, smallest_normal)


class _Casts:
    """The dynamic casts of one linear's GEMMs, each amax reduced over the groups of the axes its scale covers;
    a scale that two casts share (same tensor, same covered axes) is reduced once."""

    def __init__(
        self,
        spec: Float8Spec,
        groups: dict[str, comm.Group],
        probe: torch.Tensor | None,
        known: dict[tuple, torch.Tensor] | None = None,
    ) -> None:
        self.spec, self.ops, self.config = spec, spec.ops, spec.ops.config
        self.groups = groups
        self.probe = probe
        # the forward's reduced amaxes, reused by the backward's casts of the same tensors (a fresh dict in each
        # pass: under torch.compile a pass may mutate only what it created)
        self.amax: dict[tuple, torch.Tensor] = dict(known or {})

    def __call__(self, t: torch.Tensor, name: str, axes: str, cast, role, dim: int):
        """`t` (2-D, its axes named by `axes`, e.g. "mk") cast by `cast` (a torchao CastConfig); `dim`: the axis
        an axiswise scale runs along (the reduced one)."""
        ops = self.ops
        if cast.scaling_type is ops.disabled:
            return t
        tensorwise = cast.scaling_granularity is ops.tensorwise
        covered = axes if tensorwise else axes[dim]
        key = (name, covered)
        amax = self.amax.get(key)
        if amax is None:
            amax = ops.tensor_to_amax(
                t, False, None, cast.scaling_granularity, None if tensorwise else dim
            )
            for axis in covered:
                group = self.groups.get(axis)
                if group is not None and group.active:
                    amax = comm.all_reduce(amax, group, "max")
            self.amax[key] = amax
        scale = ops.amax_to_scale(amax, cast.target_dtype, self.config.round_scales_to_power_of_2)
        if self.probe is not None:
            _record(self.probe, PROBE_ROLES.index(name), t, t.float() * scale, cast.target_dtype)
        return ops.to_float8(t, scale, cast.target_dtype, ops.mm, role, None if tensorwise else dim)


class _Float8MatMul(torch.autograd.Function):
    """torchao's `matmul_with_hp_or_float8_args` (its three GEMMs and six casts, the same configs and axes),
    with each cast's amax taken over the whole logical tensor (`_Casts`)."""

    @staticmethod
    def forward(ctx, x, weight_t, spec, groups, probe):
        casts = _Casts(spec, groups, probe)
        ctx.save_for_backward(x, weight_t)
        c, role = casts.config, casts.ops.role
        x2 = x.reshape(-1, x.shape[-1])
        x8 = casts(x2, "x", "mk", c.cast_config_input, role.INPUT, -1)
        w8 = casts(weight_t, "w", "kn", c.cast_config_weight, role.WEIGHT, 0)
        ctx.spec, ctx.groups, ctx.probe, ctx.amax = spec, groups, probe, casts.amax
        return torch.mm(x8, w8).reshape(*x.shape[:-1], weight_t.shape[1])

    @staticmethod
    def backward(ctx, grad):
        x, weight_t = ctx.saved_tensors
        casts = _Casts(ctx.spec, ctx.groups, ctx.probe, ctx.amax)
        c, role = casts.config, casts.ops.role
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        # grad_input = grad · W: reduced over n
        g8 = casts(g2, "g", "mn", c.cast_config_grad_output, role.GRAD_OUTPUT, -1)
        w8 = casts(weight_t, "w", "kn", c.cast_config_weight_for_grad_input, role.WEIGHT, -1)
        grad_x = torch.mm(g8, w8.t()).reshape(*grad.shape[:-1], weight_t.shape[0])
        # grad_weight = gradᵀ · x: reduced over m
        g8 = casts(g2, "g", "mn", c.cast_config_grad_output_for_grad_weight, role.GRAD_OUTPUT, 0)
        x8 = casts(x2, "x", "mk", c.cast_config_input_for_grad_weight, role.INPUT, 0)
        grad_w_t = torch.mm(g8.t(), x8).t()
        return grad_x, grad_w_t, None, None, None
