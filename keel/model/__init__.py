"""Llama-style decoder as a flat layer list, plus Hugging Face interop (`keel.model.hf`)."""

from keel.model.hf import from_hf_state_dict, to_hf_config, to_hf_state_dict
from keel.model.kernels import apply_rotary
from keel.model.layers import Attention, RMSNorm, RotaryEmbedding, SwiGLU, make_norm
from keel.model.llama import (
    Block,
    CausalLM,
    EmbeddingLayer,
    FinalNorm,
    OutputLayer,
    VocabParallelLoss,
    build_layers,
    causal_lm_loss,
    compile_blocks,
    flops_per_token,
    init_weights,
    num_params,
)
from keel.model.param_groups import weight_decay_groups

__all__ = [
    "Attention",
    "Block",
    "CausalLM",
    "EmbeddingLayer",
    "FinalNorm",
    "OutputLayer",
    "VocabParallelLoss",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "apply_rotary",
    "build_layers",
    "causal_lm_loss",
    "compile_blocks",
    "flops_per_token",
    "from_hf_state_dict",
    "init_weights",
    "make_norm",
    "num_params",
    "to_hf_config",
    "to_hf_state_dict",
    "weight_decay_groups",
]
