"""Checkpoint bookkeeping: 'latest' only names whole checkpoints; old ones are pruned; metrics rewind on resume."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from keel.parallel.topology import Topology
from keel.training.checkpoint import COMPLETE, Checkpointer, TrainState
from keel.training.metrics import MetricsWriter, read_metrics


class FakeEngine:
    """Writes a file where DeepSpeed would; enough to exercise Keel's bookkeeping around it."""

    def zero_optimization_stage(self) -> int:
        return 1

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False  # Keel writes 'latest' itself, after every rank finished
        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        torch.save(client_state, path / "mp_rank_00_model_states.pt")


def test_latest_skips_half_written_and_prunes(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2, topology=Topology.from_env())
    engine = FakeEngine()
    for step in (10, 20, 30):
        ckpt.save(engine, TrainState(step=step, consumed_samples=step * 8))
    assert ckpt.complete_tags() == ["step00000020", "step00000030"]  # keep_last=2 pruned step 10
    assert ckpt.latest_tag() == "step00000030"
    # A crash while writing step 40: files exist but no completion marker, and 'latest' was never moved.
    (tmp_path / "step00000040").mkdir()
    (tmp_path / "step00000040" / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    assert ckpt.latest_tag() == "step00000030"
    # Even if 'latest' pointed at it (e.g. written by another tool), an incomplete checkpoint is never chosen.
    (tmp_path / "latest").write_text("step00000040")
    assert ckpt.latest_tag() == "step00000030"
    manifest = json.loads((tmp_path / "step00000030" / COMPLETE).read_text())
    assert manifest["consumed_samples"] == 240 and manifest["topology"]["world_size"] == 1


def test_resaving_a_step_marks_it_incomplete_until_done(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=3, topology=Topology.from_env())

    class Crashing(FakeEngine):
        def save_checkpoint(self, *args, **kwargs):
            raise OSError("disk full")

    ckpt.save(FakeEngine(), TrainState(step=10, consumed_samples=80))
    try:
        ckpt.save(Crashing(), TrainState(step=10, consumed_samples=80))
    except OSError:
        pass
    assert ckpt.latest_tag() is None


def test_metrics_rewind_on_resume_keeps_discarded_records(tmp_path):
    writer = MetricsWriter(tmp_path, True, resumed_step=0, log_interval=100, total_steps=20)
    for step in range(1, 16):
        writer.log({"step": step, "loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_s": 1.0})
    writer.close()
    writer = MetricsWriter(tmp_path, True, resumed_step=10, log_interval=100, total_steps=20)
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 11))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.discarded.jsonl")] == list(range(11, 16))
