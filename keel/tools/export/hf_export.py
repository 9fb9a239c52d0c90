"""`keel export RUN_DIR OUT_DIR`: a checkpoint as a Hugging Face `LlamaForCausalLM` (or, for MoE,
`MixtralForCausalLM`: keel/tools/export/mixtral.py) directory.

The weights stream shard by shard: tensors are grouped in HF order into safetensors files of at most
`max_shard_bytes` (a tensor larger than that gets a file of its own), each group read from the checkpoint
(keel/tools/export/checkpoint_reader.py), split into HF tensors, written with `safetensors.torch.save_file` and freed
before the next, so peak memory is one shard plus the tensor being assembled — not the model.

Everything is written into a hidden temp sibling of OUT_DIR, renamed to OUT_DIR only once complete; an existing
OUT_DIR is refused, never replaced.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from keel.config import ConfigError, ModelConfig
from keel.model.hf import hf_parts, keel_names, llama_cannot_express, to_hf_config
from keel.run_dir import temp_sibling
from keel.tools.export.checkpoint_reader import (
    CheckpointReader,
    KeelCheckpoint,
    logical_numel,
    open_checkpoint,
)
from keel.tools.export.hf_tokenizer import write_tokenizer
from keel.tools.export.mixtral import Unit, check_mixtral, mixtral_config, mixtral_units

log = logging.getLogger("keel")
DEFAULT_SHARD_BYTES = 2 * 2**30
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class ExportResult:
    out_dir: Path
    step: int
    shards: int
    total_bytes: int
    master_weights: bool


def check_exportable(ckpt: KeelCheckpoint) -> None:
    """Refuse, in one line, a model HF's Llama cannot represent."""
    model = ckpt.cfg.model
    if model.norm != "rmsnorm":
        raise ConfigError(
            f"model.norm={model.norm}: HF Llama has RMSNorm only, so this run does not export"
        )
    if reason := llama_cannot_express(model):
        raise ConfigError(f"{reason}, so this run does not export")
    if model.moe_experts:
        check_mixtral(model)
        if ckpt.pp > 1:
            raise ConfigError(
                f"{ckpt.tag_dir}: an MoE checkpoint at pp={ckpt.pp} does not export yet (pipeline "
                "stages keep their experts in other files); export MoE runs trained at pp=1"
            )


def export_units(cfg: ModelConfig) -> list[Unit]:
    """(Keel names, → HF tensors) in HF order: one Keel tensor per unit for Llama, E experts' for Mixtral's
    fused expert tensors."""
    if cfg.moe_experts:
        return mixtral_units(cfg)
    return [([name], lambda t, name=name: hf_parts(cfg, name, t[name])) for name in keel_names(cfg)]


def plan_shards(reader: CheckpointReader, units: list[Unit], max_bytes: int) -> list[list[Unit]]:
    """Units grouped in order into shards of at most `max_bytes` of fp32 (one oversized unit alone)."""
    shards: list[list[Unit]] = [[]]
    size = 0
    for unit in units:
        nbytes = 4 * sum(logical_numel(reader.layouts[name]) for name in unit[0])
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += nbytes
    return shards


def write_weights(reader: CheckpointReader, out: Path, max_bytes: int) -> tuple[int, int]:
    """The sharded safetensors and (for several shards) their index; returns (shards, total bytes)."""
    cfg = reader.ckpt.cfg.model
    shards = plan_shards(reader, export_units(cfg), max_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for number, units in enumerate(shards, start=1):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        )
        logical = reader.read([name for names, _ in units for name in names])
        tensors = {}
        for names, to_hf in units:
            tensors.update(to_hf({name: logical[name] for name in names}))
        del logical
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        for hf_name, tensor in tensors.items():
            weight_map[hf_name] = file
            total += tensor.numel() * tensor.element_size()
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return len(shards), total


def export_hf(
    run_dir: Path,
    out_dir: Path,
    step: int | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> ExportResult:
    """Write `out_dir` (which must not exist) from the run's checkpoint at `step` (default: latest)."""
    from transformers import GenerationConfig  # slow to import (seconds): only when an export runs

    out_dir = Path(out_dir).resolve()
    if out_dir.exists():
        raise ConfigError(
            f"{out_dir} already exists; export into a new directory (nothing there is replaced)"
        )
    if max_shard_bytes <= 0:
        raise ConfigError(f"--max-shard-size must be > 0 bytes, got {max_shard_bytes}")
    ckpt = open_checkpoint(Path(run_dir), step)
    check_exportable(ckpt)
    reader = CheckpointReader(ckpt)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out_dir)
    tmp.mkdir()
    try:
        special = write_tokenizer(ckpt.data, tmp)
        moe = bool(ckpt.cfg.model.moe_experts)
        make_config = mixtral_config if moe else to_hf_config
        config = make_config(ckpt.cfg.model, max_position_embeddings=ckpt.cfg.data.seq_len)
        for key, value in special.items():
            setattr(config, key, value)
        config.architectures = ["MixtralForCausalLM" if moe else "LlamaForCausalLM"]
        config.dtype = "float32"
        config.save_pretrained(tmp)
        GenerationConfig(**special).save_pretrained(tmp)
        shards, total = write_weights(reader, tmp, max_shard_bytes)
        provenance = {
            "run_dir": str(ckpt.run_dir),
            "step": ckpt.step,
            "checkpoint": str(ckpt.tag_dir),
            "layout": {"tp": ckpt.tp, "pp": ckpt.pp, "dp": ckpt.dp, "zero_stage": ckpt.zero_stage},
            "precision": ckpt.precision,
            "weights": _weights_source(ckpt),
        }
        (tmp / "keel_export.json").write_text(json.dumps(provenance, indent=2) + "\n")
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out_dir, ckpt.step, shards, total, ckpt.exports_master)


def _weights_source(ckpt: KeelCheckpoint) -> str:
    if ckpt.zero_stage == 3:
        return "fp32 master weights (ZeRO-3 optimizer partitions, via DeepSpeed's zero_to_fp32)"
    if ckpt.precision == "fp32":
        return "module weights (fp32: the master weights themselves)"
    if ckpt.reads_zero12_master:
        return f"fp32 master weights (ZeRO-{ckpt.zero_stage} optimizer partitions)"
    return f"{ckpt.precision} module weights cast to fp32 (no fp32 master read at ZeRO-{ckpt.zero_stage}, pp={ckpt.pp})"
