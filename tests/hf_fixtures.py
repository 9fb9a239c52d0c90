"""Keel run dirs with checkpoints in DeepSpeed's file layout, written in-process (no engine, no ranks).

Keel's init draws each logical tensor identically at every tp size (keel/model/init.py), so building the model
once per tp rank with a `LayerParallel` of that rank gives exactly the shards a tp-wide run starts from; saving them
under DeepSpeed's names (`mp_rank_<tp>_model_states.pt` for pp = 1, `layer_<index>-model_<tp>-model_states.pt`
for a pipeline; MoE experts in `layer_<moe layer>_expert_<id>_mp_rank_<tp>_model_states.pt`, as
DeepSpeed's `_save_moe_checkpoint` writes them) gives a checkpoint whose export must equal the tp = 1 model.
The real engines' files are tested against the same reader in the slow tests (tests/test_hf_export.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
import yaml

from keel.config import RunConfig, build_config
from keel.data.tokenizer import train_tokenizer
from keel.model import CausalLM
from keel.parallel.layer_parallel import LayerParallel
from keel.run_dir import COMPLETE, LATEST, tag_for
from keel.training.checkpoint.store import TrainState

EXPERT_KEY = "deepspeed_moe.experts.deepspeed_experts"
TINY_MODEL = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, vocab_pad_multiple=64
)


def sample_docs(n: int = 60) -> list[str]:
    words = [
        "def",
        "return",
        "class",
        "import",
        "self",
        "value",
        "json",
        "None",
        "12345",
        "Ä€漢字",
        "  ",
        "\n\t",
    ]
    return [
        " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(40)) + "\n" for i in range(n)
    ]


def write_run(
    run_dir: Path,
    model: dict | None = None,
    tp: int = 1,
    pp: int = 1,
    step: int = 5,
    complete: bool = True,
    tokenizer: Path | None = None,
) -> tuple[RunConfig, CausalLM]:
    """A run dir with one checkpoint at `step`; returns the run's config and its tp = 1 model (the reference)."""
    cfg = build_config({"model": {**TINY_MODEL, **(model or {})}, "parallel": {"tp": tp, "pp": pp}})
    run_dir.mkdir(parents=True)
    if tokenizer is None:
        tokenizer = train_tokenizer(sample_docs(), 300, run_dir / "tok").model_path
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (run_dir / "ds_config.json").write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    (run_dir / "data.json").write_text(json.dumps({"tokenizer": str(tokenizer)}))
    tag_dir = run_dir / "checkpoints" / tag_for(step)
    tag_dir.mkdir(parents=True)
    for rank in range(tp):
        state = CausalLM(
            cfg.model, seed=7, parallel=LayerParallel.without_groups(tp=tp, tp_rank=rank)
        ).state_dict()
        if pp == 1:
            for key in [
                k for k in state if EXPERT_KEY in k
            ]:  # DeepSpeed: one file per expert of each MoE layer
                block, expert = (
                    int(key.split(".")[1]) - 1,
                    int(key.split(EXPERT_KEY + ".")[1].split(".")[0]),
                )
                path = tag_dir / f"layer_{block}_expert_{expert}_mp_rank_{rank:02d}_model_states.pt"
                torch.save(
                    {**(torch.load(path) if path.is_file() else {}), key: state.pop(key)}, path
                )
            torch.save(
                {"module": state, "ds_version": "0.19.8"},
                tag_dir / f"mp_rank_{rank:02d}_model_states.pt",
            )
            continue
        for index in range(cfg.model.n_layers + 3):
            prefix = f"layers.{index}."
            layer = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            # the pipeline's tied copy
            if cfg.model.tie_embeddings and index == cfg.model.n_layers + 2:
                layer = {"tok_embeddings.weight": layer["output.weight"]}
            torch.save(layer, tag_dir / f"layer_{index:02d}-model_{rank:02d}-model_states.pt")
    if complete:
        files = {p.name: p.stat().st_size for p in sorted(tag_dir.iterdir())}
        topology = {
            "world_size": tp * pp,
            "tp": tp,
            "pp": pp,
            "dp": 1,
            "ep": 1,
            "sp": 1,
            "zero_stage": 0,
        }
        manifest = {
            "tag": tag_for(step),
            **asdict(TrainState(step=step)),
            "topology": topology,
            "files": files,
        }
        (tag_dir / COMPLETE).write_text(json.dumps(manifest))
        (run_dir / "checkpoints" / LATEST).write_text(tag_for(step))
    return cfg, CausalLM(cfg.model, seed=7).eval()
