"""The mixture-of-experts feed-forward: router, SwiGLU experts sharded over ep (and tp), optional shared expert.

One MoE layer is one tensor-parallel region, like the dense MLP: the tokens enter once (gathered under SP), every
tp rank routes them identically, each expert is a tp-sharded SwiGLU whose partial outputs leave through the
region's exit. Across the ep group the routed rows travel by all-to-all (keel/parallel/experts.py).

The auxiliary losses cannot ride on the layer's output (a pipeline stage passes one tensor on), so they are
attached to the backward pass instead (`_AttachAuxLoss`, Megatron's MoEAuxLossAutoScaler): the forward is the
identity, the backward gives the aux loss the gradient the main loss has at that point — `aux_grad_scale`, which
the trainer sets to loss_scale / gradient_accumulation_steps each step — so training minimises
`loss + aux` exactly as if it had been added to the loss, at any pp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from torch import nn

from keel.config import ModelConfig
from keel.model.layers import SwiGLU
from keel.model.router import Router, Routing
from keel.parallel.experts import (
    Routes,
    combine,
    dispatch,
    exchange_counts,
    expert_group_name,
    mark_expert_param,
    register_expert_groups,
)
from keel.parallel.float8 import Float8Spec
from keel.parallel.layer_parallel import NO_PARALLEL, LayerParallel
from keel.parallel.tensor import enter, exit


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: `y` unchanged. Backward: `y`'s gradient passes through and `aux` receives `scale`."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_like = scale, (aux.shape, aux.dtype, aux.device)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_like
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class ExpertStats:
    """Routing counts accumulated over training forwards (detached, on the layer's device): `step_routed` per
    step (the balancing bias), the rest since the last health check."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        # explicit device: the layer may be built on meta (keel/model/materialize.py); counters are real state
        self.step_routed = torch.zeros(num_experts, dtype=torch.float64, device="cpu")
        self.reset()

    def reset(self) -> None:
        device = self.step_routed.device
        # rows chosen, pre-drop
        self.routed = torch.zeros(self.num_experts, dtype=torch.float64, device=device)
        self.dropped = torch.zeros((), dtype=torch.float64, device=device)
        # Σ over tokens of routing entropy
        self.entropy = torch.zeros((), dtype=torch.float64, device=device)
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)

    @torch.no_grad()
    def add(self, route: Routing) -> None:
        if self.step_routed.device != route.experts.device:
            self.step_routed = self.step_routed.to(route.experts.device)
            self.reset()
        counts = torch.bincount(route.experts.flatten(), minlength=self.num_experts).double()
        self.step_routed += counts
        self.routed += counts
        self.dropped += (~route.keep).sum().double()
        p = route.probs.double()
        self.entropy += -(p * p.clamp_min(1e-30).log()).sum()
        self.tokens += route.experts.shape[0]

    def vector(self) -> torch.Tensor:
        """[routed × E, dropped, entropy, tokens] as one tensor (one all-reduce for every layer)."""
        return torch.cat(
            [self.routed, self.dropped.view(1), self.entropy.view(1), self.tokens.view(1)]
        )


class MoE(DeepSpeedMoE):
    """The MoE feed-forward of one block. A `deepspeed.moe.layer.MoE` by type only, so DeepSpeed treats the
    model as MoE (expert gradient reduction, ZeRO expert param groups, per-expert checkpoint files).

    Submodule names follow DeepSpeed's checkpoint code, which finds experts by the key pattern
    `deepspeed_moe.experts.deepspeed_experts.<local id>` and treats every other key containing "expert" as one
    too — so nothing else here has "expert" in its name.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        parallel: LayerParallel = NO_PARALLEL,
        layer_id: int = 0,
        fp8: Float8Spec | None = None,
    ) -> None:
        # DeepSpeed's __init__ would build its own gate, experts and process groups
        nn.Module.__init__(self)
        ep = parallel.ep
        self.tp, self.ep = parallel.tp, ep
        self.layer_id = layer_id  # the block's index, for health reports
        self.num_experts = cfg.moe_experts
        self.ep_size = ep.size
        self.expert_group_name = expert_group_name(ep.size)
        self.num_local_experts = cfg.moe_experts // ep.size
        self.router = Router(cfg, parallel)
        hidden = cfg.moe_ffn_hidden or cfg.ffn_dim
        first = ep.rank * self.num_local_experts
        self.deepspeed_moe = nn.Module()
        self.deepspeed_moe.experts = nn.Module()
        self.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList(
            SwiGLU(cfg, parallel, hidden) for _ in range(self.num_local_experts)
        )
        for offset, mlp in enumerate(self.local_experts):
            for param in mlp.parameters():
                mark_expert_param(param, ep.size)
                # init draws each expert from its own stream (llama.py)
                param.expert_id = first + offset
        # `fp8` reaches the shared expert only: the routed experts stay in high precision (keel/model/precision.py)
        self.shared = SwiGLU(cfg, parallel, fp8=fp8) if cfg.moe_shared_expert else None
        self.aux_grad_scale = 1.0  # set by the trainer: loss_scale / gradient_accumulation_steps
        # None: torch's grouped GEMM on CUDA in bf16, the expert loop elsewhere
        self.grouped_gemm: bool | None = None
        self.stats = ExpertStats(cfg.moe_experts)

    @property
    def local_experts(self) -> nn.ModuleList:
        return self.deepspeed_moe.experts.deepspeed_experts

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls this on every MoE layer at start; Keel's groups already exist."""
        register_expert_groups(self.ep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter(x, self.tp)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        route = self.router(tokens)
        y = self._run_experts(tokens, route)
        if self.shared is not None:
            y = y + self.shared.inner(tokens)
        if self.training:
            self.stats.add(route)
            if route.aux_loss.requires_grad:
                # aux is identical on every tp rank, and its gradient is summed over tp (router weight, tokens)
                y = _AttachAuxLoss.apply(y, route.aux_loss, self.aux_grad_scale / self.tp.size)
        return exit(y.view(shape), self.tp)

    def _run_experts(self, tokens: torch.Tensor, route: Routing) -> torch.Tensor:
        """Sort the kept (token, expert) rows by expert, run them through their experts (wherever those live),
        and sum each token's weighted expert outputs. One host read: the split sizes (`exchange_counts`)."""
        k = route.experts.shape[1]
        # dropped rows take the id E: they sort after every kept row and fall outside the counts, so the kept rows
        # are a prefix of `order` whose length the one read of the counts gives (no `nonzero`, another sync)
        key = torch.where(route.keep.flatten(), route.experts.flatten(), self.num_experts)
        order = torch.argsort(key, stable=True)
        routes = exchange_counts(torch.bincount(key, minlength=self.num_experts + 1)[:-1], self.ep)
        rows = order[: routes.sent_rows]
        token_of_row = torch.div(rows, k, rounding_mode="floor")
        inputs, regrouped = dispatch(tokens[token_of_row], routes, self.ep)
        outputs = combine(self._expert_mlps(inputs, routes), routes, regrouped, self.ep)
        weights = route.weights.flatten()[rows].unsqueeze(1).to(outputs.dtype)
        return torch.zeros_like(tokens).index_add(0, token_of_row, outputs * weights)

    def _expert_mlps(self, inputs: torch.Tensor, routes: Routes) -> torch.Tensor:
        """Each local expert's SwiGLU on its contiguous rows: one grouped GEMM per projection where torch's kernel
        is the fast path (CUDA, bf16), else one GEMM per expert (torch's CPU grouped_mm is a slower loop)."""
        grouped = (
            self.grouped_gemm
            if self.grouped_gemm is not None
            else (inputs.is_cuda and inputs.dtype == torch.bfloat16)
        )
        if not grouped:
            chunks = inputs.split(routes.expert_counts)
            return torch.cat([mlp.inner(chunk) for mlp, chunk in zip(self.local_experts, chunks)])
        # the experts stay separate Parameters (DeepSpeed's per-expert checkpoint keys): stacked per call
        offsets = routes.device_counts.cumsum(0).to(torch.int32)
        weights = [mlp.w13.weight for mlp in self.local_experts]
        weights += [mlp.w2.weight for mlp in self.local_experts]
        return _GroupedSwiGLU.apply(inputs, offsets, len(self.local_experts), *weights)


class _GroupedSwiGLU(torch.autograd.Function):
    """Every local expert's SwiGLU on its contiguous rows, one grouped GEMM per projection, with the experts'
    weights stacked for the kernel in forward and stacked again in backward rather than kept.

    Left to autograd, `torch.stack` + `grouped_mm` would keep the stacked copies from forward to backward: a second
    copy of every local expert's weights per MoE layer, per micro-batch in flight (bench/moe_memory.py). Saved here:
    the rows, the gate/up projection and references to the weights themselves; the restack is one copy, freed
    as soon as the backward GEMMs are done."""

    @staticmethod
    def forward(ctx, inputs: torch.Tensor, offsets: torch.Tensor, experts: int, *weights):
        w13, w2 = _stacked(weights, experts)
        gate_up = F.grouped_mm(inputs, w13.transpose(-2, -1), offs=offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)
        ctx.experts = experts
        ctx.save_for_backward(inputs, offsets, gate_up, *weights)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        inputs, offsets, gate_up, *weights = ctx.saved_tensors
        grad_out = (
            grad_out.contiguous()
        )  # the kernel needs real strides (a sum's gradient is expanded)
        w13, w2 = _stacked(weights, ctx.experts)
        gate, up = gate_up.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        # out = h @ w2ᵀ per expert, h = silu(gate) * up
        grad_h = F.grouped_mm(grad_out, w2, offs=offsets)
        grad_w2 = F.grouped_mm(grad_out.t(), silu * up, offs=offsets)  # [E, dim, hidden]
        grad_gate_up = torch.cat(
            [grad_h * up * sig * (1 + gate * (1 - sig)), grad_h * silu], dim=-1
        )
        # gate_up = inputs @ w13ᵀ per expert
        grad_inputs = F.grouped_mm(grad_gate_up, w13, offs=offsets)
        grad_w13 = F.grouped_mm(grad_gate_up.t(), inputs, offs=offsets)  # [E, 2·hidden, dim]
        grads = [g.view(w.shape) for g, w in zip(grad_w13, weights[: ctx.experts])]
        grads += [g.view(w.shape) for g, w in zip(grad_w2, weights[ctx.experts :])]
        return grad_inputs, None, None, *grads


def _stacked(weights, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([E, 2·hidden, dim] gate and up, [E, dim, hidden] down) from the experts' separate weights."""
    w13 = torch.stack(weights[:experts]).flatten(1, -2)
    return w13, torch.stack(weights[experts:])


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
