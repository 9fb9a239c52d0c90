"""A Keel MoE model as HF `MixtralForCausalLM`: what converts, and which Keel tensors make each HF tensor.

Mixtral is the closest HF class to Keel's MoE: every block routed, softmax router, top-k renormalised, SwiGLU
experts, no shared expert, no router bias. transformers 5 stores a layer's experts fused: `gate_up_proj`
[E, 2·ffn, dim] (gate rows, then up: exactly a Keel expert's `w13` [2, ffn, dim] flattened) and `down_proj`
[E, dim, ffn] (each expert's `w2`), so one HF tensor is made from E Keel tensors — an export *unit*.
Refused, in one line each: what Mixtral cannot compute (shared expert, sigmoid scoring, top-1, whose weight
Keel leaves unnormalised while Mixtral makes it 1, a balancing bias that moves choices, dense blocks between
MoE ones). Capacity dropping is a training device; HF's Mixtral is dropless.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from keel.config import ConfigError, ModelConfig

Unit = tuple[list[str], Callable[[dict[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]]
_ATTENTION = (
    ("attention_norm.weight", "input_layernorm.weight"),
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
)
_EXPERT = "feed_forward.deepspeed_moe.experts.deepspeed_experts"


def check_mixtral(cfg: ModelConfig) -> None:
    problems = {
        "model.moe_shared_expert=true (Mixtral has no shared expert)": cfg.moe_shared_expert,
        f"model.moe_scoring={cfg.moe_scoring} (Mixtral routes by softmax)": cfg.moe_scoring
        != "softmax",
        "model.moe_top_k=1 (Keel weights the expert by its probability, Mixtral by 1)": cfg.moe_top_k
        == 1,
        f"model.moe_every={cfg.moe_every} (every Mixtral block is MoE)": cfg.moe_every != 1,
        "model.moe_bias_update > 0 (Mixtral has no choice bias)": cfg.moe_bias_update > 0,
        f"model.norm={cfg.norm} (Mixtral has RMSNorm only)": cfg.norm != "rmsnorm",
    }
    for what, bad in problems.items():
        if bad:
            raise ConfigError(f"{what}: this MoE model does not export to MixtralForCausalLM")


def mixtral_config(cfg: ModelConfig, max_position_embeddings: int):
    # slow to import (seconds): only when an MoE model exports
    from transformers import (
        MixtralConfig,
    )

    return MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.moe_ffn_hidden or cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_dropout=0.0,
        num_local_experts=cfg.moe_experts,
        num_experts_per_tok=cfg.moe_top_k,
        router_jitter_noise=0.0,
        output_router_logits=False,
        router_aux_loss_coef=cfg.moe_aux_loss,
        sliding_window=None,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _one(hf: str) -> Callable:
    return lambda tensors: [(hf, next(iter(tensors.values())).contiguous())]


def mixtral_units(cfg: ModelConfig) -> list[Unit]:
    """Export units in HF order; vocabulary rows are already cut by the reader (logical tensors)."""
    units: list[Unit] = [(["layers.0.tok_embeddings.weight"], _one("model.embed_tokens.weight"))]
    experts = range(cfg.moe_experts)
    for layer in range(cfg.n_layers):
        keel, hf = f"layers.{layer + 1}.", f"model.layers.{layer}."
        units += [([keel + k], _one(hf + h)) for k, h in _ATTENTION]
        units.append(
            (
                [keel + "attention.wkv.weight"],
                lambda t, hf=hf: [
                    (hf + f"self_attn.{part}_proj.weight", w.clone())
                    for part, w in zip("kv", next(iter(t.values())))
                ],
            )
        )
        units.append(([keel + "feed_forward.router.weight"], _one(hf + "mlp.gate.weight")))
        units.append(
            (
                [f"{keel}{_EXPERT}.{e}.w13.weight" for e in experts],
                lambda t, hf=hf: [
                    (
                        hf + "mlp.experts.gate_up_proj",
                        torch.stack([w.flatten(0, 1) for w in t.values()]),
                    )
                ],
            )
        )
        units.append(
            (
                [f"{keel}{_EXPERT}.{e}.w2.weight" for e in experts],
                lambda t, hf=hf: [(hf + "mlp.experts.down_proj", torch.stack(list(t.values())))],
            )
        )
    units.append(([f"layers.{cfg.n_layers + 1}.norm.weight"], _one("model.norm.weight")))
    if not cfg.tie_embeddings:
        units.append(([f"layers.{cfg.n_layers + 2}.output.weight"], _one("lm_head.weight")))
    return units
