"""The optimizer's parameter groups: AdamW's weight decay on matrices only (GPT-2/Megatron practice)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from keel.adapters.deepspeed_internals import logical_shape


def decays(param: torch.Tensor) -> bool:
    """Weight decay applies to matrices, not norms or biases, by the logical shape (a model built under
    `deepspeed.zero.Init` is already partitioned: every parameter a flat, empty tensor)."""
    return len(logical_shape(param)) >= 2


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer param groups: decay matrices, not norms or biases (`decays`); shared Parameters appear once."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():  # parameters() already yields each shared Parameter once
        if param.requires_grad:
            (decay if decays(param) else no_decay).append(param)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def layer_groups_of(layers: Iterable[nn.Module]) -> set[str]:
    """The names of the `weight_decay_groups` the parameters of `layers` would fill."""
    return {
        "decay" if decays(q) else "no_decay"
        for layer in layers
        for q in layer.parameters()
        if q.requires_grad
    }
