"""The tokenizer's facts reach the run before any rank starts: its vocabulary and special ids fill the model config,
the run dir records which tokenizer it was, and a resume with a different tokenizer stops with one line.

A checkpoint's embedding rows mean the ids of the tokenizer it was trained with; resuming it on another tokenizer's
ids would train on without an error and quietly wreck the model, so the check is by content hash, not by path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from keel.config import ConfigError, ModelConfig, RunConfig
from keel.data import Tokenizer
from keel.run_dir import RunDir, has_checkpoint

SPECIAL_ROLES = ("bos_id", "eos_id", "pad_id")


def tokenizer_record(
    tokenizer: Tokenizer, source: Path | None, source_sha256: str | None
) -> dict[str, Any]:
    """What data.json keeps: the source the user named (or `train`), its hash, and the loaded copy's facts."""
    record = tokenizer.record()
    record["source"] = "train" if source is None else str(source)
    record["sha256"] = tokenizer.sha256 if source_sha256 is None else source_sha256
    return record


def resolve_special_ids(model: ModelConfig, tokenizer: Tokenizer) -> None:
    """model.bos_id/eos_id/pad_id from the tokenizer (-1 for a role it lacks); an explicit other value is refused."""
    for role in SPECIAL_ROLES:
        actual = getattr(tokenizer, role)
        actual = -1 if actual is None else actual
        given = getattr(model, role)
        if given not in (-1, actual):
            has = "none" if actual == -1 else str(actual)
            raise ConfigError(
                f"model.{role}={given} differs from the tokenizer's ({has}, {tokenizer.path}); "
                f"leave model.{role} unset (-1) to take the tokenizer's"
            )
        setattr(model, role, actual)


def check_same_tokenizer(run_dir: Path, cfg: RunConfig, record: dict[str, Any]) -> None:
    """Refuse to resume checkpoints in `run_dir` that a different tokenizer's ids trained (by content hash)."""
    if not cfg.checkpoint.resume or not has_checkpoint(run_dir):
        return
    try:
        recorded = json.loads(RunDir(run_dir).data.read_text())
        old = recorded.get("tokenizer_info")
    except (OSError, ValueError, AttributeError):
        return  # no readable record of the old run: nothing to compare against
    if not isinstance(old, dict) or old.get("sha256") in (None, record["sha256"]):
        return
    # trained on the corpus: the corpus (or size) changed
    if old.get("source") == record["source"] == "train":
        raise ConfigError(
            f"data.tokenizer: the checkpoints in {run_dir} were trained with a tokenizer trained on their corpus "
            f"(sha256 {str(old['sha256'])[:12]}), this run's data.corpus / data.tokenizer_vocab_size train another "
            f"(sha256 {record['sha256'][:12]}); give the old one, data.tokenizer={recorded.get('tokenizer')}, or use "
            "a new --run-dir, or checkpoint.resume=false"
        )
    raise ConfigError(
        f"data.tokenizer: the checkpoints in {run_dir} were trained with tokenizer {old.get('source')} (sha256 "
        f"{str(old['sha256'])[:12]}), this run gives {record['source']} (sha256 {record['sha256'][:12]}); use the "
        "same tokenizer, a new --run-dir, or checkpoint.resume=false"
    )
