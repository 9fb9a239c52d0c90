"""`model.init_from: HF_DIR`: start training from a Hugging Face Llama's safetensors weights.

`check_hf_dir` compares the HF config with `model.*` before any rank starts (one line per mismatch, both values
named). `load_hf_weights` then writes each of this rank's parameters from the files — after the model is built
and before the engine is created — through the same `Placement.fill` hook init uses, so every layout loads the
way it initialises: a tp shard reads only its rows or columns (`safe_open(...).get_slice(name)[rows, cols]`), a
pipeline stage only its layers, and under ZeRO-3 a rank only the rows of its flat partition. Nothing is
gathered and no collective is issued; a read's temporary is the slice it writes plus at most one row.

Only safetensors are read: pickle weights (`.bin`, `.pt`) can run code on load and are refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from keel.adapters.deepspeed_internals import logical_shape
from keel.config import ConfigError, ModelConfig
from keel.model.hf import hf_sources, llama_cannot_express
from keel.model.llama import EmbeddingLayer
from keel.model.materialize import Placement

_INDEX = "model.safetensors.index.json"


def _hf_config(hf_dir: Path) -> dict:
    config = hf_dir / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"model.init_from: {hf_dir} has no config.json; give a directory written by "
            "save_pretrained"
        )
    return json.loads(config.read_text())


def check_hf_dir(cfg: ModelConfig) -> None:
    """Refuse, before launch, an init_from directory Keel cannot load into `cfg` (vocab_size 0: not yet known)."""
    hf_dir = Path(cfg.init_from).expanduser()
    if not hf_dir.is_dir():
        raise ConfigError(f"model.init_from: {hf_dir} is not a directory")
    hf = _hf_config(hf_dir)
    arch = (hf.get("architectures") or [hf.get("model_type", "unknown")])[0]
    if arch != "LlamaForCausalLM":
        raise ConfigError(
            f"model.init_from: {hf_dir} holds a {arch}; Keel loads LlamaForCausalLM weights only"
        )
    if cfg.norm != "rmsnorm" or cfg.moe_experts:
        raise ConfigError(
            "model.init_from: a Llama checkpoint loads only into a dense model.norm=rmsnorm model"
        )
    if reason := llama_cannot_express(cfg):
        raise ConfigError(f"model.init_from: {reason}; set them back to load Llama weights")
    weight_files(hf_dir)
    rope = hf.get("rope_parameters") or {}
    expected = {
        "dim": (cfg.dim, hf.get("hidden_size")),
        "n_layers": (cfg.n_layers, hf.get("num_hidden_layers")),
        "n_heads": (cfg.n_heads, hf.get("num_attention_heads")),
        "n_kv_heads": (
            cfg.n_kv_heads,
            hf.get("num_key_value_heads", hf.get("num_attention_heads")),
        ),
        "ffn_dim": (cfg.ffn_dim, hf.get("intermediate_size")),
        "rope_theta": (cfg.rope_theta, rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "norm_eps": (cfg.norm_eps, hf.get("rms_norm_eps")),
        "tie_embeddings": (cfg.tie_embeddings, hf.get("tie_word_embeddings", False)),
        "head_dim (dim / n_heads)": (cfg.head_dim, hf.get("head_dim") or cfg.head_dim),
    }
    if cfg.vocab_size:
        expected["vocab_size"] = (cfg.vocab_size, hf.get("vocab_size"))
    hf_keys = {
        "dim": "hidden_size",
        "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads",
        "n_kv_heads": "num_key_value_heads",
        "ffn_dim": "intermediate_size",
        "rope_theta": "rope_theta",
        "norm_eps": "rms_norm_eps",
        "tie_embeddings": "tie_word_embeddings",
        "vocab_size": "vocab_size",
        "head_dim (dim / n_heads)": "head_dim",
    }
    problems = [
        f"model.init_from: model.{key}={ours} but {hf_dir}/config.json has {hf_keys[key]}={theirs}"
        for key, (ours, theirs) in expected.items()
        if ours != theirs
    ]
    unsupported = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
    problems += [
        f"model.init_from: {hf_dir}/config.json has {key}={hf[key]!r}; Keel's Llama has {value!r}"
        for key, value in unsupported.items()
        if key in hf and hf[key] != value
    ]
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        problems.append(
            f"model.init_from: {hf_dir}/config.json scales RoPE ({rope or hf.get('rope_scaling')}); "
            "Keel has plain RoPE only"
        )
    if problems:
        raise ConfigError("\n".join(problems))


def weight_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name → the safetensors file holding it (the index's map, or the one model.safetensors)."""
    index = hf_dir / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / file for name, file in weight_map.items()}
    single = hf_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise ConfigError(
            f"model.init_from: {hf_dir} has pickle weights ({pickles[0]}), which Keel does not load "
            "(unpickling runs code); re-save them with save_pretrained(safe_serialization=True)"
        )
    raise ConfigError(f"model.init_from: {hf_dir} has no model.safetensors or {_INDEX}")


class HFWeights:
    """Lazily opened safetensors files of one HF directory; `rows(name, r0, r1, c0, c1)` reads one window."""

    def __init__(self, hf_dir: Path) -> None:
        self.files = weight_files(hf_dir)
        self.hf_dir = hf_dir
        self._open: dict[Path, object] = {}

    def slice(self, name: str):
        if name not in self.files:
            raise ConfigError(f"model.init_from: {self.hf_dir} lacks the tensor {name}")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path].get_slice(name)

    def window(
        self, name: str, rows: tuple[int, int], cols: tuple[int, int] | None
    ) -> torch.Tensor:
        """Rows [r0, r1) (and columns [c0, c1)) of an HF tensor as fp32, zero past its last row (vocab padding)."""
        part = self.slice(name)
        shape = part.get_shape()
        r1 = min(rows[1], shape[0])
        if cols is None:
            values = part[rows[0] : r1] if rows[0] < r1 else torch.empty(0)
        else:
            values = (
                part[rows[0] : r1, cols[0] : cols[1]]
                if rows[0] < r1
                else torch.empty(0, cols[1] - cols[0])
            )
        values = values.float()
        if r1 - rows[0] < rows[1] - rows[0]:
            pad = torch.zeros((rows[1] - max(r1, rows[0]), *values.shape[1:]))
            values = torch.cat([values, pad])
        return values


def _writer(weights: HFWeights, param: nn.Parameter, names: tuple[str, ...]):
    """`write(out, flat)` for `Placement.fill`: this rank's shard (or the flat window of it) from `names`, the
    HF tensors of the parameter's parts (stacked on dim 0 when fused)."""
    shape = tuple(logical_shape(param))
    sharded = getattr(param, "tp_size", 1) > 1
    dim = param.partition_dim if sharded else None
    rank = getattr(param, "tp_rank", 0)
    part_shape = shape[1:] if len(names) > 1 else shape
    part_dim = None if dim is None else (dim - 1 if len(names) > 1 else dim)
    rows = part_shape[0]
    cols = math.prod(part_shape[1:])
    row0 = rank * rows if part_dim == 0 else 0
    col0 = rank * cols if part_dim == 1 else 0
    part_numel = rows * cols

    def write(out: torch.Tensor, flat: tuple[int, int] | None) -> None:
        out = out.view(-1)
        start, end = flat or (0, part_numel * len(names))
        for index, name in enumerate(names):
            lo, hi = max(start, index * part_numel), min(end, (index + 1) * part_numel)
            if lo >= hi:
                continue
            first, last = (lo - index * part_numel) // cols, -(-(hi - index * part_numel) // cols)
            col_window = (col0, col0 + cols) if len(part_shape) > 1 else None
            values = weights.window(name, (row0 + first, row0 + last), col_window).reshape(-1)
            offset = lo - index * part_numel - first * cols
            out[lo - start : hi - start].copy_(values[offset : offset + hi - lo])

    return write


@torch.no_grad()
def load_hf_weights(
    layers: list[tuple[int, nn.Module]], cfg: ModelConfig, placement: Placement | None = None
) -> None:
    """Overwrite the parameters of `layers` ((index in the full layer list, layer) pairs: a whole model or one
    pipeline stage) with `cfg.init_from`'s values, each rank reading only what it holds."""
    weights = HFWeights(Path(cfg.init_from).expanduser())
    done: set[int] = set()
    for index, layer in layers:
        for name, param in layer.named_parameters():
            if id(param) in done:
                continue
            done.add(id(param))
            key = (
                "layers.0.tok_embeddings.weight"
                if isinstance(layer, EmbeddingLayer)
                else f"layers.{index}.{name}"
            )
            (placement or Placement()).fill(param, _writer(weights, param, hf_sources(cfg, key)))
