"""The Llama decoder as a flat list of layers: `[EmbeddingLayer, Block × n_layers, OutputLayer]`.

Every layer maps one tensor to one tensor (tokens [b, s] → hidden [b, s, d] → … → logits [b, s, vocab]), so the
same classes serve the single-process `CausalLM` and, later, DeepSpeed's `PipelineModule` as layer specs.
Throughout, a layer's *index* is its position in the full list: 0 is the embedding, 1..n_layers are the blocks
(block `layer_id` = index - 1), n_layers + 1 is the output layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from keel.adapters.deepspeed_internals import logical_shape
from keel.config import ConfigError, ModelConfig, validate_model
from keel.model.document_mask import DocumentLayout, document_layout
from keel.model.init import base_init_std, deepnorm_alpha, fill_shard_, matrix_init_std
from keel.model.kernels import fused_linear_cross_entropy
from keel.model.kernels import resolve as resolve_kernels
from keel.model.layers import Attention, RotaryEmbedding, SwiGLU, make_norm
from keel.model.materialize import Placement
from keel.model.precision import block_fp8
from keel.model.router import is_moe_block
from keel.parallel.cross_entropy import vocab_parallel_cross_entropy
from keel.parallel.layer_parallel import NO_PARALLEL, LayerParallel
from keel.parallel.tensor import (
    VocabParallelEmbedding,
    enter,
    exit,
    mark_sharded,
    padded_vocab_size,
)
from keel.parallel.ulysses import sequence_mean

# An expert's local position in its MoE layer's module path (replaced by its global id in init keys).
_LOCAL_EXPERT = re.compile(r"deepspeed_moe\.experts\.deepspeed_experts\.\d+\.")


def vocab_rows(cfg: ModelConfig, parallel: LayerParallel) -> int:
    """The embedding's and head's row count over all tp ranks: the vocabulary padded for an even tp split."""
    return padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple, parallel.tp.size)


class EmbeddingLayer(nn.Module):
    """Token ids [b, s] → hidden [b, s, dim] (sequence-sharded under SP). RoPE lives in the attentions.

    The table is split by vocabulary rows over tp and padded to `vocab_rows`; padding rows are never looked up.
    Under Ulysses sequence and context parallelism only this rank's tokens are embedded.
    """

    def __init__(self, cfg: ModelConfig, parallel: LayerParallel = NO_PARALLEL) -> None:
        super().__init__()
        self.tp = parallel.tp
        self.sequence_shard = parallel.sequence_shard
        self.tok_embeddings = VocabParallelEmbedding(
            cfg.vocab_size, vocab_rows(cfg, parallel), cfg.dim, self.tp
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return exit(self.tok_embeddings(self.sequence_shard(tokens)), self.tp)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Use the table as the tied output head: hidden → logits over this rank's vocabulary shard."""
        return F.linear(enter(x, self.tp), self.tok_embeddings.weight)


class Block(nn.Module):
    """A transformer block; dropout sits on each residual branch's output, before the add.

    Where it normalizes is `model.norm_placement` (Megatron/DeepNet semantics; f is attention, then the MLP):
      pre       x + f(norm(x))                     Llama, GPT-2
      post      norm(α·x + f(x))                   the original Transformer; α = 1, or DeepNet's (2N)^¼ under
                                                   `model.deepnorm`
      sandwich  x + out_norm(f(norm(x)))           CogView's sandwich-LN: the branch output is normalized too
    The same parameter names (`attention_norm`, `ffn_norm`) serve every placement; sandwich adds
    `attention_out_norm` and `ffn_out_norm`. The feed-forward is the dense SwiGLU, or an MoE layer in every
    `model.moe_every`-th block.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        parallel: LayerParallel = NO_PARALLEL,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.placement = cfg.norm_placement
        self.residual_scale = deepnorm_alpha(cfg) if cfg.deepnorm else 1.0
        self.attention_norm = make_norm(cfg, parallel)
        fp8 = block_fp8(cfg, layer_id, parallel)
        self.attention = Attention(cfg, parallel, fp8, rotary)
        self.ffn_norm = make_norm(cfg, parallel)
        sandwich = cfg.norm_placement == "sandwich"
        self.attention_out_norm = make_norm(cfg, parallel) if sandwich else None
        self.ffn_out_norm = make_norm(cfg, parallel) if sandwich else None
        if is_moe_block(cfg, layer_id):
            # imports DeepSpeed (~1.5 s, a stdout notice on CPU): dense models never do
            from keel.model.moe import (
                MoE,
            )

            self.feed_forward = MoE(cfg, parallel, layer_id, fp8)
        else:
            self.feed_forward = SwiGLU(cfg, parallel, fp8=fp8)
        # its sharded_rng: dropout on sequence shards (and found there by checkpoints)
        self.tp = parallel.tp
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, document: DocumentLayout | None = None) -> torch.Tensor:
        x = self._residual(
            x, lambda h: self.attention(h, document), self.attention_norm, self.attention_out_norm
        )
        return self._residual(x, self.feed_forward, self.ffn_norm, self.ffn_out_norm)

    def _residual(
        self,
        x: torch.Tensor,
        branch: Callable[[torch.Tensor], torch.Tensor],
        norm: nn.Module,
        out_norm: nn.Module | None,
    ) -> torch.Tensor:
        if self.placement == "post":
            skip = x * self.residual_scale if self.residual_scale != 1.0 else x
            return norm(skip + self._dropout(branch(x)))
        out = branch(norm(x))
        return x + self._dropout(out if out_norm is None else out_norm(out))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout.p == 0.0 or self.tp.sharded_rng is None:
            return self.dropout(x)
        with self.tp.sharded_rng.fork():  # sequence shards differ per TP rank: so must their masks
            return self.dropout(x)


class FinalNorm(nn.Module):
    """The norm after the last block; its own layer so a pipeline can tie the head to the embedding."""

    def __init__(self, cfg: ModelConfig, parallel: LayerParallel = NO_PARALLEL) -> None:
        super().__init__()
        self.norm = make_norm(cfg, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class OutputLayer(nn.Module):
    """Vocabulary projection → logits [b, s, vocab_rows / tp] (this rank's vocabulary shard).

    Given `tied_embedding`, `output.weight` *is* that embedding's weight Parameter (one tensor, one gradient).
    A pipeline ties across stages differently: its last stage holds a second `EmbeddingLayer` and calls
    `EmbeddingLayer.project` (DeepSpeed's tied-layer mechanism keeps the two copies equal).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        tied_embedding: nn.Module | None = None,
        parallel: LayerParallel = NO_PARALLEL,
    ) -> None:
        super().__init__()
        tp = self.tp = parallel.tp
        if tied_embedding is None:
            weight = nn.Parameter(torch.empty(vocab_rows(cfg, parallel) // tp.size, cfg.dim))
            # column-parallel: vocabulary rows split; the logical tensor is the true vocabulary (padding rows are zero)
            mark_sharded(weight, 0, (cfg.vocab_size, cfg.dim), tp)
            self.output = _HeadProjection(weight)
            return
        # No weight of its own, not even briefly: under zero.Init it would be partitioned and kept by DeepSpeed.
        want = (vocab_rows(cfg, parallel) // tp.size, cfg.dim)
        if tuple(logical_shape(tied_embedding.weight)) != want:
            raise ValueError(
                f"tied embedding has shape {tuple(logical_shape(tied_embedding.weight))}, the head needs {want}"
            )
        self.output = _HeadProjection(tied_embedding.weight)

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_fn: VocabParallelLoss | None = None,
    ) -> torch.Tensor:
        """Logits, or — given `labels` and a `loss_fn` that fuses — the loss straight from the hidden states."""
        return self.output(enter(x, self.tp), labels, loss_fn)


class _HeadProjection(nn.Module):
    """The head's projection (state-dict key `output.weight`, tied or not). The fused loss runs inside this
    module's own call, the one that owns the weight: ZeRO-3 gathers a partitioned weight only there."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_fn: VocabParallelLoss | None = None,
    ) -> torch.Tensor:
        if labels is not None and loss_fn is not None:
            return loss_fn.fused(x, self.weight, labels)
        return F.linear(x, self.weight)


def build_layers(cfg: ModelConfig, parallel: LayerParallel = NO_PARALLEL) -> list[nn.Module]:
    """`[EmbeddingLayer, Block × n_layers, FinalNorm, OutputLayer]`, head tied to the embedding if asked.

    With tensor parallelism (`parallel.tp`) each layer holds this rank's shards, with expert parallelism
    (`parallel.ep`) this rank's experts; under Ulysses (`parallel.sp`) layers see this rank's sequence chunk.
    Weights are uninitialised until `init_weights` runs.
    """
    validate_model(cfg)
    if cfg.vocab_size <= 0:
        raise ConfigError(
            f"model.vocab_size: must be > 0 to build the model (got {cfg.vocab_size}); resolve it from the tokenizer"
        )
    embedding = EmbeddingLayer(cfg, parallel)
    rotary = RotaryEmbedding(
        cfg.head_dim, cfg.rope_theta
    )  # one pair of RoPE tables for every block
    blocks = [Block(cfg, layer_id, parallel, rotary) for layer_id in range(cfg.n_layers)]
    head = OutputLayer(cfg, embedding.tok_embeddings if cfg.tie_embeddings else None, parallel)
    return [embedding, *blocks, FinalNorm(cfg, parallel), head]


def logical_name(name: str, param: torch.Tensor) -> str:
    """The name init keys a parameter's blocks by: its name in the layer, an expert's local position replaced by
    its global id (`feed_forward.experts.<id>.w13.weight`), so its values do not depend on which rank holds it."""
    expert = getattr(param, "expert_id", None)
    return name if expert is None else _LOCAL_EXPERT.sub(f"experts.{expert}.", name)


def init_key(name: str, param: torch.Tensor) -> str | tuple[str, ...]:
    """`logical_name`, or for a fused parameter one name per part, each that of the projection it fuses
    (`feed_forward.w13.weight` → `feed_forward.w1.weight`, `feed_forward.w3.weight`): fusing changes no value."""
    key = logical_name(name, param)
    parts = getattr(param, "part_names", None)
    if parts is None:
        return key
    head, _, leaf = key.rpartition(".")
    parent = head.rpartition(".")[0]
    return tuple(".".join(filter(None, (parent, part, leaf))) for part in parts)


# Whether model.init draws from the ±3σ truncated normal; keyed by exactly keel.config.INITS (tested).
TRUNCATED_BY_INIT = {"normal": False, "truncated_normal": True, "small_init": False}


@torch.no_grad()
def init_weights(
    layers: Iterable[nn.Module],
    cfg: ModelConfig,
    seed: int,
    first_index: int = 0,
    placement: Placement | None = None,
) -> None:
    """Initialise `layers` deterministically and independently of how the full layer list is split or sharded.

    Matrices (embedding, projections, head) get N(0, std²), or the ±3σ truncated normal when
    `cfg.init == "truncated_normal"`; std is `init_std` or small-init's (`base_init_std`), the embedding's
    `embedding_init_std` when set, and `matrix_init_std` scales residual outputs (and DeepNet's matrices); norm
    weights are 1, biases 0.

    A matrix draws in row blocks keyed by (`seed`, its layer's index in the full list, its logical name, block)
    (keel/model/init.py), so a pipeline stage calling `init_weights(stage_layers, cfg, seed,
    first_index=index_of_its_first_layer)`, a tp shard and an ep rank all reproduce exactly their part of the
    single-process model. Every copy of the embedding table — and a tied head, shared here or not — draws as
    layer 0's `tok_embeddings.weight`. `placement.fill` writes each value where the parameter keeps it (under
    ZeRO-3: only this rank's partition).
    """
    truncated = TRUNCATED_BY_INIT[
        cfg.init
    ]  # cfg was validated: by build_layers, or as the run's config
    # a Parameter shared between layers is initialised once, by its first owner
    done: set[int] = set()
    for offset, layer in enumerate(layers):
        index = first_index + offset
        for name, param in layer.named_parameters():
            if id(param) in done:
                continue
            done.add(id(param))
            (placement or Placement()).fill(
                param, _writer(layer, index, name, param, cfg, seed, truncated)
            )


def _writer(
    layer: nn.Module,
    index: int,
    name: str,
    param: nn.Parameter,
    cfg: ModelConfig,
    seed: int,
    truncated: bool,
) -> Callable[[torch.Tensor, tuple[int, int] | None], None]:
    """How `param`'s value (or a flat window of it) is written: drawn blocks, zeros (biases) or ones (norms)."""
    if len(logical_shape(param)) >= 2:
        tied_head = (
            isinstance(layer, OutputLayer) and cfg.tie_embeddings and name == "output.weight"
        )
        # every copy of the table draws as layer 0's
        if tied_head or isinstance(layer, EmbeddingLayer):
            std, key_index, key = (
                cfg.embedding_init_std or base_init_std(cfg),
                0,
                "tok_embeddings.weight",
            )
        else:
            std, key_index, key = matrix_init_std(name, cfg), index, init_key(name, param)
        return lambda out, flat: fill_shard_(
            param, std, truncated, seed, key_index, key, out=out, flat=flat
        )
    value = 0.0 if name.endswith("bias") else 1.0
    return lambda out, flat: out.fill_(value)


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; `labels[b, t]` is the target for `logits[b, t]` (already shifted).

    Positions labelled `ignore_index` are excluded from the mean. Also the pipeline's `loss_fn(outputs, labels)`.
    """
    return F.cross_entropy(
        logits.float().flatten(0, -2), labels.flatten(), ignore_index=ignore_index
    )


class CausalLM(nn.Module):
    """The whole layer list in one process: logits, or the loss when `labels` are given.

    `parallel` is this rank's place in the tp, sp and ep groups (default: a single process); `placement` says where
    the layers are built and materialized (default: meta, then fp32 on the CPU).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int = 0,
        parallel: LayerParallel = NO_PARALLEL,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        checkpoint_interval: int = 0,
        placement: Placement | None = None,
        document_eos: int | None = None,
        engine_averages_sp: bool = False,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        # data.document_mask: attention and positions restart after this id
        self.document_eos = document_eos
        self.checkpoint_interval = checkpoint_interval
        placement = placement or Placement()  # on meta, then this rank's shards on the CPU in fp32
        self.layers = nn.ModuleList(placement.build(lambda: build_layers(cfg, parallel)))
        init_weights(self.layers, cfg, seed, placement=placement)
        # the engine averages the sequence ranks' gradients (keel/engine/ds_config.py averages_sequence_ranks)
        self.loss_fn = VocabParallelLoss(cfg, parallel, label_smoothing, z_loss, engine_averages_sp)
        self.cp = parallel.cp

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (this rank's vocabulary shard, padding included) or, given `labels`, the mean loss."""
        # any callable(logits, labels) works
        fused = labels is not None and getattr(self.loss_fn, "fuses_head", False)
        layers = self.layers[:-1] if fused else self.layers
        h = tokens
        document = (
            None
            if self.document_eos is None
            else document_layout(tokens, self.document_eos, self.cp)
        )
        step = (
            self.checkpoint_interval
            if self.training and self.checkpoint_interval > 0
            else len(self.layers)
        )
        for start in range(0, len(layers), step):
            chunk = layers[start : start + step]
            if step < len(self.layers) and torch.is_grad_enabled():
                # recompute this chunk's activations in backward (as the pipeline does every N layers)
                h = torch.utils.checkpoint.checkpoint(
                    _run_layers, chunk, h, document, use_reentrant=False
                )
            else:
                h = _run_layers(chunk, h, document)
        # through the head's own call, so hooks on it (non-finite localization) still see it
        if fused:
            return self.layers[-1](h, labels, self.loss_fn)
        return h if labels is None else self.loss_fn(h, labels)


def compile_blocks(layers: Iterable[nn.Module]) -> None:
    """`torch.compile` each transformer block in place (torchtitan's per-block scheme): identical blocks share
    one compiled graph (parameters are graph inputs), the fusions inductor finds are per block, and parameter
    names and state dicts stay those of the eager model (`Module.compile`, not a wrapper).

    A compiled block's RMSNorm, RoPE and silu·mul take the torch path whatever `model.kernels` says: inductor
    fuses them itself, and Liger's kernels inside the graph defeat its analysis (their scalar arguments) and
    write their gradients into their saved inputs; on an H200 a 435M model compiled with them had non-finite
    gradients at its first step, the same model on the torch path trained (bench/results/device_check_gpu_*).
    Outside the blocks (the final norm, the fused head + loss) Liger stays."""
    for layer in layers:
        if isinstance(layer, Block):
            for module in layer.modules():
                if getattr(module, "liger", False):
                    module.liger = False
            layer.compile()


def _run_layers(
    layers: Iterable[nn.Module], h: torch.Tensor, document: DocumentLayout | None = None
) -> torch.Tensor:
    for layer in layers:
        h = layer(h, document) if document is not None and isinstance(layer, Block) else layer(h)
    return h


class VocabParallelLoss:
    """`loss_fn(logits_shard, labels)`: cross-entropy over the true vocabulary, never gathering full logits.

    A plain callable (not a module) so it adds no parameters; the pipeline engine takes it as its loss_fn.
    Under Ulysses sequence or context parallelism it scores this rank's labels and returns the full-sequence mean.
    `fuses_head` (Liger kernels at tp = 1): `CausalLM` hands it the hidden states and the head's weight instead
    of logits (`fused`), so the full logits never exist. The pipeline always passes logits.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        parallel: LayerParallel = NO_PARALLEL,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        engine_averages_sp: bool = False,
    ):
        tp = parallel.tp
        self.group = tp.group if tp.size > 1 else None
        self.vocab_start = tp.rank * vocab_rows(cfg, parallel) // tp.size
        self.vocab_size = cfg.vocab_size
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.scale = 1.0  # fault injection multiplies a step's loss (faults.spike_step)
        self.seq = parallel.seq
        self.sequence_shard = parallel.sequence_shard
        # the pipeline engine: see keel/parallel/ulysses.py
        self.engine_averages_sp = engine_averages_sp
        self.fuses_head = tp.size == 1 and resolve_kernels(cfg.kernels) == "liger"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the logits are the head's output, used by nothing after the loss: it may overwrite them
        loss = vocab_parallel_cross_entropy(
            logits,
            self.sequence_shard(labels),
            self.group,
            self.vocab_start,
            self.vocab_size,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            consume=True,
        )
        return self._finish(loss)

    def fused(
        self, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """The same loss from the final hidden states and the head's weight, by Liger's fused linear + CE."""
        loss = fused_linear_cross_entropy(
            hidden,
            head_weight,
            self.sequence_shard(labels),
            self.vocab_size,
            self.label_smoothing,
            self.z_loss,
        )
        return self._finish(loss)

    def _finish(self, loss: torch.Tensor) -> torch.Tensor:
        loss = sequence_mean(loss, self.seq, self.engine_averages_sp)
        return loss * self.scale if self.scale != 1.0 else loss


def num_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Unique parameter count; `exclude_embeddings` drops the token table (and so a head tied to it)."""
    excluded: set[int] = set()
    if exclude_embeddings:
        excluded = {
            id(p) for m in model.modules() if isinstance(m, EmbeddingLayer) for p in m.parameters()
        }
    return sum(p.numel() for p in model.parameters() if id(p) not in excluded)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6·N + 12·L·H·Q·T (PaLM, Chowdhery et al. 2022, appendix B).

    N counts the matmul weights a token passes through: attention and MLP projections of every block (in an MoE
    block: the router, its top-k experts and the shared expert) plus the output head (tied or not; the embedding
    lookup is not a matmul, norms are negligible). L = n_layers, H·Q = n_heads·head_dim, T = seq_len;
    12·L·H·Q·T is the QKᵀ and attention·V work, forward and backward, without discounting the causal mask.
    MFU = tokens/s · flops_per_token / peak FLOP/s.
    """
    if cfg.vocab_size <= 0:
        raise ConfigError(f"model.vocab_size: must be > 0 to count FLOPs (got {cfg.vocab_size})")
    q_width = cfg.n_heads * cfg.head_dim
    kv_width = cfg.n_kv_heads * cfg.head_dim
    attention = cfg.dim * q_width + 2 * cfg.dim * kv_width + q_width * cfg.dim
    dense_mlp = 3 * cfg.dim * cfg.ffn_dim
    # an MoE block's token passes through its router, top_k experts and the shared expert (active parameters)
    moe_mlp = (
        cfg.dim * cfg.moe_experts
        + cfg.moe_top_k * 3 * cfg.dim * (cfg.moe_ffn_hidden or cfg.ffn_dim)
        + (dense_mlp if cfg.moe_shared_expert else 0)
    )
    n = sum(
        attention + (moe_mlp if is_moe_block(cfg, i) else dense_mlp) for i in range(cfg.n_layers)
    )
    n += cfg.dim * cfg.vocab_size
    return 6 * n + 12 * cfg.n_layers * q_width * seq_len
