"""Checkpoint bookkeeping: 'latest' only names whole checkpoints; old ones are pruned; metrics rewind on resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from keel.parallel.random import ShardedRNG
from keel.parallel.tensor import TPContext
from keel.parallel.topology import Topology
from keel.run_dir import COMPLETE
from keel.training.checkpoint import rng_state
from keel.training.checkpoint.store import Checkpointer, NoIntactCheckpoint, TrainState
from keel.training.observe.metrics import MetricsWriter, read_metrics


class FakeEngine:
    """Writes a file where DeepSpeed would, through DeepSpeed's own checkpoint engine (the seam Keel routes each
    write through); enough to exercise Keel's bookkeeping around it."""

    module = torch.nn.Linear(2, 2)

    def __init__(self):
        self.checkpoint_engine = TorchCheckpointEngine()

    def zero_optimization_stage(self) -> int:
        return 1

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False  # Keel writes 'latest' itself, after every rank finished
        path = Path(save_dir) / tag
        self.checkpoint_engine.makedirs(str(path), exist_ok=True)
        self.checkpoint_engine.save(client_state, str(path / "mp_rank_00_model_states.pt"))
        self._copy_recovery_script(save_dir)

    def _copy_recovery_script(self, save_path: str) -> None:
        """DeepSpeed copies its zero_to_fp32.py beside the checkpoints at every ZeRO save."""
        (Path(save_path) / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script\n")


@pytest.mark.fault(
    "crash while writing a checkpoint", "half-written checkpoint never chosen; latest kept"
)
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


@pytest.mark.fault("save fails while re-saving a step", "step marked incomplete, never loaded")
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
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.discarded.jsonl")] == list(
        range(11, 16)
    )


@pytest.mark.fault(
    "checkpoint file truncated or missing", "chosen checkpoint refused in one line; exit 6"
)
def test_agreed_tag_is_verified_against_the_manifest_file_list(tmp_path):
    """One process is rank 0 and its only verifier: a listed file truncated (or gone) stops the choice — the
    checkpoint is set aside, and with none left the run stops rather than start from step 0."""
    ckpt = Checkpointer(tmp_path, keep_last=3, topology=Topology.from_env())
    ckpt.save(FakeEngine(), TrainState(step=10, consumed_samples=80))
    manifest = ckpt.read_manifest("step00000010")
    assert (
        set(manifest["files"])
        == {"mp_rank_00_model_states.pt", "keel_rng_rank0.pt"}
        == set(manifest["sha256_chunks"])
    )
    assert ckpt.agreed_latest() == "step00000010"
    assert ckpt.agreed_at_or_before(9) is None
    shard = tmp_path / "step00000010" / "mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:-1])
    (tmp_path / "step00000010" / "keel_rng_rank0.pt").unlink()
    # a new process (this one verified step 10 and would not read it again)
    ckpt = Checkpointer(tmp_path, keep_last=3, topology=Topology.from_env())
    with pytest.raises(
        NoIntactCheckpoint, match="every checkpoint in .* is corrupt .step00000010 set aside"
    ) as err:
        ckpt.agreed_latest()
    assert err.value.exit_code == 6
    # kept; `latest` had no target (zero_to_fp32.py: DeepSpeed's, beside the checkpoints)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000010.corrupt", "zero_to_fp32.py"]


class DropoutModel(torch.nn.Module):
    """Two layers sharing one tensor-parallel context, as the model's blocks do: one sharded stream."""

    def __init__(self):
        super().__init__()
        tp = TPContext(sequence_parallel=True, sharded_rng=ShardedRNG(seed=5, tp_rank=1))
        self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        self.a.tp = self.b.tp = tp

    def draw(self) -> torch.Tensor:
        with self.a.tp.sharded_rng.fork():
            sharded = torch.rand(3)
        return torch.cat([sharded, torch.rand(3)])


def test_rng_state_restores_every_stream_and_reports_what_an_old_checkpoint_lacks():
    model = DropoutModel()
    assert rng_state.sharded_rngs(model) == [model.a.tp.sharded_rng]
    model.draw()
    saved = rng_state.capture(model)
    want = model.draw()
    model.draw()
    assert rng_state.restore(saved, model) == []
    # the sharded dropout stream and the default one both resumed
    assert torch.equal(model.draw(), want)
    old = {
        k: saved[k] for k in ("python", "numpy", "torch")
    }  # a checkpoint from before the new fields
    assert rng_state.restore(old, DropoutModel()) == ["sharded"]
    # no dropout stream: nothing is missing
    assert rng_state.restore(old, torch.nn.Linear(2, 2)) == []
