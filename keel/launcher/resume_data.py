"""A resume continues on the data its checkpoint was counting, or says why not — before any rank starts.

A checkpoint records how many samples the run consumed, not which: sample i is the i-th of an order fixed by the
token files, the blend weights, the window length, the validation split, the seed and the order's own algorithm
(`sample_order`, changed once, when Keel stopped storing a permutation per epoch). Resuming with any of those
changed silently continues at the same count in a different order (samples seen twice, others never). So the run
dir's recorded data (`data.json`, the resolved `config.yaml`) is compared with the new run's, and each changed field
is named with its old and new value; `data.allow_change_on_resume: true` turns the refusal into a warning for a
deliberate change (an annealing mixture, a longer context).

A corpus is identified by its token stores' sizes (tokens and documents per source), not by paths or the cache
location: the same text prepared again elsewhere is the same corpus, and an edited file is not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from keel.config import ConfigError, RunConfig, build_config
from keel.run_dir import RunDir, has_checkpoint


def _sources(data: dict[str, Any]) -> list[dict[str, Any]]:
    return data["sources"] if "sources" in data else [data]


def _corpus(cfg: RunConfig, data: dict[str, Any]) -> tuple[Any, str]:
    """(identity, how to show it): tokens and documents per source; shown as the config names it, with sizes."""
    sizes = [(s.get("num_tokens"), s.get("num_docs")) for s in _sources(data)]
    shown = ", ".join(
        f"{n:,} tokens in {d:,} documents" if n is not None else "size not recorded"
        for n, d in sizes
    )
    return sizes, f"{json.dumps(cfg.data.corpus)} ({shown})"


def _weights(data: dict[str, Any]) -> list[float] | None:
    return [round(float(s["weight"]), 6) for s in data["sources"]] if "sources" in data else None


def data_changes(
    old_cfg: RunConfig, old_data: dict[str, Any], cfg: RunConfig, data: dict[str, Any]
) -> list[str]:
    """'field old → new' for every setting that orders the samples and differs between the two runs."""
    changes = []
    (old_sizes, old_shown), (new_sizes, new_shown) = _corpus(old_cfg, old_data), _corpus(cfg, data)
    # an old record without sizes
    if old_sizes != new_sizes and not any(None in pair for pair in old_sizes):
        changes.append(f"data.corpus {old_shown} → {new_shown}")
    elif _weights(old_data) != _weights(data):
        changes.append(f"data.corpus weights {_weights(old_data)} → {_weights(data)}")
    # a record without one was written before Keel recorded its order (keel/data/samples.py SAMPLE_ORDER)
    old_order = old_data.get("sample_order", "numpy-permutation")
    if old_order != data.get("sample_order", old_order):
        changes.append(f"the sample order {old_order} → {data['sample_order']} (Keel's own)")
    for field, old, new in (
        ("data.seq_len", old_cfg.data.seq_len, cfg.data.seq_len),
        ("data.val_fraction", old_cfg.data.val_fraction, cfg.data.val_fraction),
        ("train.seed", old_cfg.train.seed, cfg.train.seed),
    ):
        if old != new:
            changes.append(f"{field} {old} → {new}")
    return changes


def check_same_data(run_dir: Path, cfg: RunConfig, data: dict[str, Any]) -> None:
    """Refuse (or, with data.allow_change_on_resume, warn about) resuming `run_dir`'s checkpoints on data that
    orders the samples differently; a run dir without checkpoints or without a readable record is not checked."""
    if not cfg.checkpoint.resume or not has_checkpoint(run_dir):
        return
    try:
        old_cfg = build_config(yaml.safe_load(RunDir(run_dir).config.read_text()))
        old_data = json.loads(RunDir(run_dir).data.read_text())
    except (OSError, ValueError, ConfigError):
        return  # nothing to compare against: an older run dir
    changes = data_changes(old_cfg, old_data, cfg, data)
    if not changes:
        return
    listed = "; ".join(changes)
    if cfg.data.allow_change_on_resume:
        print(
            f"keel: warning: resuming {run_dir} on changed data (data.allow_change_on_resume): {listed}; its "
            "sample count now indexes the new order",
            file=sys.stderr,
            flush=True,
        )
        return
    raise ConfigError(
        f"data: the checkpoints in {run_dir} count samples in the order of their data, and this run changes it: "
        f"{listed}; resuming would continue at the same count in a different order — keep the data settings, or "
        "set data.allow_change_on_resume=true for a deliberate change (e.g. an annealing mixture), or use a new "
        "--run-dir or checkpoint.resume=false"
    )
