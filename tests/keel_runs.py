"""Run real `keel train` jobs (real processes, gloo) on a tiny model and read back what they wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from keel.training.metrics import read_metrics

TINY = {
    "model.dim": 32,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "data.seq_len": 32,
    "data.tokenizer_vocab_size": 512,
    "train.global_batch_size": 8,
    "train.micro_batch_size": 2,
    "train.steps": 10,
    "train.warmup_steps": 2,
    "train.lr": 0.01,
    "train.eval_interval": 0,
    "checkpoint.interval": 0,
    "logging.log_interval": 5,
}
REPO = Path(__file__).resolve().parent.parent


def tiny_overrides(corpus: list[str], cache_dir: Path, **changes: Any) -> list[str]:
    values = {**TINY, "data.corpus": json.dumps(corpus), "data.cache_dir": str(cache_dir)}
    values.update({k.replace("__", "."): v for k, v in changes.items()})
    return [f"{k}={v}" for k, v in values.items()]


def keel_train(run_dir: Path, nproc: int, overrides: list[str], ds_config: str = "ds_configs/zero0.json",
               timeout: int = 600, expect_code: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "keel.launcher.cli", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
           "--ds-config", str(REPO / ds_config)]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != expect_code:
        raise AssertionError(f"keel train exited {proc.returncode}, expected {expect_code}:\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = run_dir / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    state = torch.load(ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return state["module"]


class RunCache:
    """Memoizes runs by their arguments so several tests can compare against one reference run."""

    def __init__(self, root: Path, cache_dir: Path, corpus: list[str]):
        self.root, self.cache_dir, self.corpus = root, cache_dir, corpus
        self._done: dict[str, Path] = {}

    def get(self, name: str, nproc: int, ds_config: str = "ds_configs/zero0.json", **changes: Any) -> Path:
        key = json.dumps([name, nproc, ds_config, sorted(changes.items())], default=str)
        if key not in self._done:
            run_dir = self.root / f"{name}-{len(self._done)}"
            keel_train(run_dir, nproc, self.overrides(**changes), ds_config)
            self._done[key] = run_dir
        return self._done[key]

    def overrides(self, **changes: Any) -> list[str]:
        return tiny_overrides(self.corpus, self.cache_dir, **changes)
