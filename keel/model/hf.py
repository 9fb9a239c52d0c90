"""Interop with Hugging Face `LlamaForCausalLM`: config and parameter names, both ways.

Keel's layers use HF's RoPE convention (rotate_half), so weights map by name with no permutation: one to one,
except that a fused Keel weight (`wkv`, `w13`: its parts stacked on dim 0) is several HF projections, one per
part.
Only RMSNorm models have an HF Llama equivalent. transformers is imported inside the functions: it is slow to
import and training never needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from keel.config import ModelConfig

if TYPE_CHECKING:
    import transformers

    from keel.model.llama import CausalLM


def llama_cannot_express(cfg: ModelConfig) -> str:
    """Why HF's Llama cannot hold this model's architecture ("" when it can): its blocks are pre-RMSNorm with
    plain residuals and no QK-norm. Init-only knobs (small_init, embedding_init_std) change nothing here."""
    knobs = [
        f"model.norm_placement={cfg.norm_placement}" if cfg.norm_placement != "pre" else "",
        "model.deepnorm=true" if cfg.deepnorm else "",
        "model.qk_norm=true" if cfg.qk_norm else "",
    ]
    knobs = [k for k in knobs if k]
    return (
        f"{', '.join(knobs)}: HF Llama has pre-norm blocks without QK-norm or scaled residuals"
        if knobs
        else ""
    )


# (Keel name inside a Block, HF names inside model.layers.{i}: one per part of a fused weight, in part order)
_BLOCK_NAMES = (
    ("attention_norm.weight", ("input_layernorm.weight",)),
    ("attention.wq.weight", ("self_attn.q_proj.weight",)),
    ("attention.wkv.weight", ("self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    ("attention.wo.weight", ("self_attn.o_proj.weight",)),
    ("ffn_norm.weight", ("post_attention_layernorm.weight",)),
    ("feed_forward.w13.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("feed_forward.w2.weight", ("mlp.down_proj.weight",)),
)
_EMBED = "model.embed_tokens.weight"
_HEAD = "lm_head.weight"


def _require_rmsnorm(cfg: ModelConfig) -> None:
    if cfg.norm != "rmsnorm":
        raise ValueError(f"HF Llama has no {cfg.norm}; only model.norm=rmsnorm converts")
    if cfg.moe_experts:
        raise ValueError(
            "HF Llama is dense; a model with model.moe_experts > 0 does not convert to LlamaForCausalLM"
        )


def _name_map(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Keel `CausalLM` state-dict name → its HF `LlamaForCausalLM` names (several for a fused weight's parts)."""
    names = {"layers.0.tok_embeddings.weight": (_EMBED,)}
    for layer_id in range(cfg.n_layers):
        for keel, hf in _BLOCK_NAMES:
            names[f"layers.{layer_id + 1}.{keel}"] = tuple(
                f"model.layers.{layer_id}.{part}" for part in hf
            )
    names[f"layers.{cfg.n_layers + 1}.norm.weight"] = ("model.norm.weight",)
    names[f"layers.{cfg.n_layers + 2}.output.weight"] = (_HEAD,)
    return names


def to_hf_config(cfg: ModelConfig, max_position_embeddings: int = 8192) -> transformers.LlamaConfig:
    """An HF `LlamaConfig` with Keel's shapes and numerics; dropout is training-only and left out.

    Token ids (bos/eos/pad) belong to the tokenizer and are left unset for the caller to fill in.
    """
    # ~3 s to import; keel.model imports this module, training never needs it
    from transformers import (
        LlamaConfig,
    )

    _require_rmsnorm(cfg)
    if cfg.vocab_size <= 0:
        raise ValueError(f"model.vocab_size must be > 0 to convert (got {cfg.vocab_size})")
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        attention_dropout=0.0,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def to_hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """`model`'s weights under HF names (tensors share storage with the model; `lm_head` is the embedding if tied)."""
    _require_rmsnorm(model.cfg)
    state = model.state_dict()
    names = _name_map(model.cfg)
    if set(state) != set(names):
        raise ValueError(f"unmapped parameters: {sorted(set(state) ^ set(names))}")
    # Keel pads the vocabulary rows (model.vocab_pad_multiple); HF holds exactly vocab_size rows.
    out = {}
    for keel, hf_names in names.items():
        parts = (state[keel],) if len(hf_names) == 1 else state[keel].unbind(0)
        out.update(
            (hf, _vocab_rows(part, hf, model.cfg.vocab_size))
            for hf, part in zip(hf_names, parts, strict=True)
        )
    return out


def from_hf_state_dict(model: CausalLM, state_dict: dict[str, torch.Tensor]) -> None:
    """Load an HF Llama state dict into `model` in place; strict, except HF's non-persistent rotary buffers.

    For a tied model, `lm_head.weight` may be absent; if present it must equal the embedding.
    """
    _require_rmsnorm(model.cfg)
    names = _name_map(model.cfg)
    known = {hf for hf_names in names.values() for hf in hf_names}
    unexpected = sorted(
        k for k in state_dict if k not in known and not k.endswith("rotary_emb.inv_freq")
    )
    if unexpected:
        raise KeyError(f"HF state dict has keys with no Keel parameter: {unexpected}")
    tied = model.cfg.tie_embeddings
    if tied and _HEAD in state_dict and _EMBED in state_dict:
        if not torch.equal(state_dict[_HEAD], state_dict[_EMBED]):
            raise ValueError(
                "model.tie_embeddings is set but lm_head.weight differs from embed_tokens.weight"
            )
    missing = sorted(hf for hf in known if hf not in state_dict and not (tied and hf == _HEAD))
    if missing:
        raise KeyError(f"HF state dict lacks {missing}")
    own = model.state_dict()
    keel_state = {}
    for keel, hf_names in names.items():
        if len(hf_names) > 1:  # a fused weight: its parts stacked on dim 0
            keel_state[keel] = torch.stack([state_dict[hf] for hf in hf_names])
            continue
        hf = hf_names[0]
        value = state_dict[_EMBED if tied and hf == _HEAD else hf]
        # pad to Keel's padded vocabulary
        if hf in (_EMBED, _HEAD) and value.shape[0] < own[keel].shape[0]:
            value = torch.cat(
                [value, value.new_zeros(own[keel].shape[0] - value.shape[0], value.shape[1])]
            )
        keel_state[keel] = value
    model.load_state_dict(keel_state, strict=True)


def keel_names(cfg: ModelConfig) -> list[str]:
    """Keel `CausalLM` state-dict names in HF order (embedding, blocks, norm, head), the tied head left out."""
    _require_rmsnorm(cfg)
    return [
        name for name, hf in _name_map(cfg).items() if not (cfg.tie_embeddings and hf == (_HEAD,))
    ]


def hf_parts(
    cfg: ModelConfig, keel_name: str, logical: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors one logical Keel tensor (unpadded, unsharded) becomes: a fused weight's parts, each its own
    contiguous tensor (safetensors refuses tensors that share storage)."""
    hf_names = _name_map(cfg)[keel_name]
    if len(hf_names) == 1:
        return [(hf_names[0], _vocab_rows(logical, hf_names[0], cfg.vocab_size).contiguous())]
    return [(hf, part.clone()) for hf, part in zip(hf_names, logical.unbind(0), strict=True)]


def hf_sources(cfg: ModelConfig, keel_name: str) -> tuple[str, ...]:
    """The HF tensors a Keel parameter is read from (its parts in order); a tied head reads the embedding."""
    hf_names = _name_map(cfg)[keel_name]
    return (_EMBED,) if cfg.tie_embeddings and hf_names == (_HEAD,) else hf_names


def _vocab_rows(tensor: torch.Tensor, hf_name: str, vocab_size: int) -> torch.Tensor:
    return tensor[:vocab_size] if hf_name in (_EMBED, _HEAD) else tensor
