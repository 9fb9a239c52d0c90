"""Asynchronous checkpoints (keel/training/checkpoint/async_save.py, host_snapshot.py).

One process: the host snapshot serializes to the bytes the original would, however the original changes after it
is taken; the whole save → publish on a stand-in engine; a failed background write publishes nothing. One spawned
one-rank world: on real engines (ZeRO 0-3, fp16, bf16, MoE, the pipeline engine) every file of an asynchronous save
equals a synchronous save's byte for byte, although training stepped between the snapshot and the write. A
multi-process run (--slow): every rank crashes while rank 1's writer is paused; the save is not published, and the
resumed run ends at the uninterrupted run's weights bitwise.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from keel.config import ConfigError
from keel.config.schema import build_config, load_config
from keel.launcher.local import free_port
from keel.parallel.topology import Topology
from keel.run_dir import COMPLETE
from keel.training.checkpoint.async_save import AsyncCheckpointer, snapshot_files, write_files
from keel.training.checkpoint.host_snapshot import HostSnapshot
from keel.training.checkpoint.store import Checkpointer, TrainState
from keel.training.checkpoint.verify import chunk_hashes
from keel.training.checkpoint.writes import SaveErrors
from tests.keel_runs import Run, final_weights, keel_train
from tests.spawned import start_world

KINDS = ["zero0", "zero1", "zero2", "zero3", "fp16", "bf16", "moe", "pipeline"]


def _saved_bytes(obj, path: Path) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)
    return path.read_bytes()


def _awkward_state() -> dict:
    """What DeepSpeed's state dicts contain, and what changes torch.save's bytes if a copy gets it wrong."""
    flat = torch.arange(12, dtype=torch.float32)
    weight = torch.nn.Parameter(torch.randn(3, 4))
    # views of one storage
    module = collections.OrderedDict(w=flat[2:8].view(2, 3), b=flat[8:], t=flat[1:7:2])
    module._metadata = collections.OrderedDict({"": {"version": 1}})
    tied, placeholder = (
        torch.randn(5, requires_grad=True),
        torch.empty(0),
    )  # ZeRO-3's tied placeholders: one storage
    return {
        "module": module,
        "param": weight,
        "tied": [tied, tied],
        "empty": [placeholder, placeholder.detach(), torch.empty(0)],
        "half": torch.randn(4).half(),
        "groups": ({"lr": 0.1, "params": [0, 1]},),
        "rng": np.random.get_state(),
        "strided": torch.randn(4, 4).t(),
        "name": "x",
        "step": 3,
    }


def test_the_snapshot_serializes_to_the_originals_bytes_after_the_original_changes(tmp_path):
    state = _awkward_state()
    expected = _saved_bytes(state, tmp_path / "sync" / "file.pt")
    snapshot = HostSnapshot(pin=False)
    snapshot.begin()
    copied = snapshot.copy(state, "file.pt")
    snapshot.wait()
    buffers = {k: b.data_ptr() for k, b in snapshot._buffers.items()}
    with torch.no_grad():  # training goes on: every original tensor changes in place
        for t in (
            state["module"]["w"],
            state["param"],
            state["tied"][0],
            state["half"],
            state["strided"],
        ):
            t.add_(1)
    assert _saved_bytes(copied, tmp_path / "async" / "file.pt") == expected
    assert (
        copied["tied"][0] is copied["tied"][1]
        and copied["module"]._metadata == state["module"]._metadata
    )
    assert snapshot.nbytes == sum(
        len(t.untyped_storage())
        for t in (
            state["module"]["w"],
            state["param"],
            state["tied"][0],
            state["half"],
            state["strided"],
        )
    )
    snapshot.begin()  # the next save of the same shapes reuses every buffer
    snapshot.copy(state, "file.pt")
    snapshot.wait()
    assert {k: b.data_ptr() for k, b in snapshot._buffers.items()} == buffers


def test_the_snapshots_clone_serializes_as_deepspeeds_clone_in_one_host_copy(tmp_path):
    """Where DeepSpeed clones a state for torch.save, the snapshot clones it instead: the same bytes, and the
    following copy keeps the clones where they are (one host copy)."""
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    state = _awkward_state()
    expected = _saved_bytes(clone_tensors_for_torch_save(state), tmp_path / "sync" / "file.pt")
    snapshot = HostSnapshot(pin=False)
    snapshot.begin()
    copied = snapshot.copy(snapshot.clone(state), "file.pt")
    snapshot.wait()
    with torch.no_grad():
        state["module"]["w"].add_(1)
        state["strided"].add_(1)
    assert _saved_bytes(copied, tmp_path / "async" / "file.pt") == expected
    tensors = [*state["module"].values(), state["param"], *state["tied"], *state["empty"]]
    tensors += [state["half"], state["strided"]]
    assert snapshot.nbytes == sum(t.numel() * t.element_size() for t in tensors)


def test_checkpoint_async_is_the_same_key_as_async_save():
    """`async` is a Python keyword, so the field is async_save; `checkpoint.async` (YAML or --set) is its alias."""
    assert build_config({"checkpoint": {"async": True}}).checkpoint.async_save
    assert load_config(None, ["checkpoint.async=true"]).checkpoint.async_save
    assert not load_config(None, ["checkpoint.async=false"]).checkpoint.async_save
    with pytest.raises(ConfigError, match=r"checkpoint\.async_save: given twice"):
        build_config({"checkpoint": {"async": True, "async_save": False}})
    with pytest.raises(ConfigError, match=r"checkpoint\.async_save: expected true or false"):
        load_config(None, ["checkpoint.async=maybe"])


class _Disk:
    """A checkpoint engine's `save` (what DeepSpeed's TorchCheckpointEngine does), which can run out of space."""

    def __init__(self):
        self.full = False

    def save(self, state_dict, path: str) -> None:
        if self.full:
            raise OSError(28, "No space left on device")
        torch.save(state_dict, path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)


class _Engine:
    """Writes two shards through its checkpoint engine, as DeepSpeed does; the weights change in place."""

    module = torch.nn.Linear(2, 2)

    def __init__(self):
        self.checkpoint_engine = _Disk()
        self.weights = torch.zeros(1000)

    def zero_optimization_stage(self) -> int:
        return 1

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        path = Path(save_dir) / tag
        self.checkpoint_engine.makedirs(str(path), exist_ok=True)
        self.checkpoint_engine.save(
            {"module": {"w": self.weights}, **client_state},
            str(path / "mp_rank_00_model_states.pt"),
        )
        self.checkpoint_engine.save(
            {"optimizer": self.weights[:10]}, str(path / "zero_pp_rank_0_optim_states.pt")
        )
        self._copy_recovery_script(save_dir)

    def _copy_recovery_script(self, save_path: str) -> None:
        """DeepSpeed copies its zero_to_fp32.py beside the checkpoints at every ZeRO save."""
        (Path(save_path) / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script\n")


def _tag_files(directory: Path, tag: str) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes() for p in sorted((directory / tag).iterdir()) if p.name != COMPLETE
    }


def test_an_async_save_publishes_what_a_synchronous_save_would(tmp_path):
    engine, topology = _Engine(), Topology.from_env()
    sync, background = (
        Checkpointer(tmp_path / "sync", 2, topology),
        Checkpointer(tmp_path / "async", 2, topology),
    )
    saver = AsyncCheckpointer(background, pin=False)
    for step in (10, 20, 30):
        state = TrainState(step=step, consumed_samples=8 * step)
        torch.manual_seed(step)
        sync.save(engine, state, guards={"g": step})
        torch.manual_seed(step)
        saver.save(engine, state, guards={"g": step})
        state.step += 1  # the loop moves on while the writer writes
        engine.weights.add_(1)
        saver.finish()
        [outcome] = saver.poll()
        assert outcome.ok and outcome.tag == f"step{step:08d}"
        assert _tag_files(tmp_path / "async", outcome.tag) == _tag_files(
            tmp_path / "sync", outcome.tag
        )
    assert background.complete_tags() == sync.complete_tags() == ["step00000020", "step00000030"]
    mine, theirs = background.read_manifest("step00000030"), sync.read_manifest("step00000030")
    assert mine == theirs and mine["step"] == 30  # the same bytes: the same sizes and sha256 too
    for name, digests in mine["sha256_chunks"].items():  # files of one chunk each here
        assert [
            hashlib.sha256((tmp_path / "async" / "step00000030" / name).read_bytes()).hexdigest()
        ] == digests
    assert not any(p.name.startswith(".") for p in (tmp_path / "async" / "step00000030").iterdir())
    assert saver.poll() == []  # nothing pending: no collective either


def test_a_save_concludes_only_once_the_step_agreed_it_written(tmp_path):
    """Polling adds no collective: the step's agreement says which save every rank has written."""
    saver = AsyncCheckpointer(Checkpointer(tmp_path, 2, Topology.from_env()), pin=False)
    saver.save(_Engine(), TrainState(step=10))
    saver.pending.writer.join()
    assert saver.writing() == ("step00000010", False)
    assert saver.poll() == [] and saver.poll(written="step00000020") == []  # not agreed yet
    [outcome] = saver.poll(written="step00000010")
    assert outcome.ok and outcome.tag == "step00000010" and saver.writing() == (None, False)


@pytest.mark.fault(
    "a background checkpoint write fails (disk full)",
    "the save is discarded on every rank: not published, its directory removed; latest stays",
)
def test_a_failed_background_write_publishes_nothing(tmp_path):
    engine = _Engine()
    checkpointer = Checkpointer(tmp_path, 3, Topology.from_env())
    saver = AsyncCheckpointer(checkpointer, pin=False)
    saver.save(engine, TrainState(step=10))
    saver.finish()
    engine.checkpoint_engine.full = True  # the disk fills while the writer writes step 20
    saver.save(engine, TrainState(step=20))
    saver.finish()
    ok, outcome = saver.poll()
    assert ok.ok and ok.step == 10
    assert (
        not outcome.ok
        and outcome.error.startswith(f"rank 0: writing {tmp_path / 'step00000020'}")
        and "[Errno 28] No space left" in outcome.error
    )
    assert not (tmp_path / "step00000020").exists()
    assert (
        checkpointer.latest_tag() == "step00000010"
        and (tmp_path / "latest").read_text() == "step00000010"
    )


# -- real engines, one spawned rank -------------------------------------------------------------------------------
def _train_step(engine, seed: int) -> None:
    from tests.test_adapters import _batches

    torch.manual_seed(seed)
    batches = [b.roll(seed, dims=1) for b in _batches()]
    if hasattr(engine, "train_batch"):
        engine.train_batch(data_iter=iter([(b[:, :-1], b[:, 1:]) for b in batches]))
        return
    for i, batch in enumerate(batches):
        engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()


def _compare_kind(kind: str, root: Path) -> dict:
    """Sync save, snapshot, a training step, then the snapshot written: the two tag directories' files."""
    from tests.test_adapters import _engine

    engine = _engine(kind)
    topology = Topology.from_env()
    _train_step(engine, 1)
    sync, background = (
        Checkpointer(root / kind / "sync", 1, topology),
        Checkpointer(root / kind / "async", 1, topology),
    )
    state = TrainState(step=1, consumed_samples=4)
    sync.save(engine, state)
    begun = SaveErrors(topology.rank)
    tag = background.begin("step00000001", begun.guard)
    snapshot = HostSnapshot(pin=False)
    with _deepspeeds_own_clones() as cloned:
        files = snapshot_files(engine, background, "step00000001", state, snapshot)
    _train_step(engine, 2)  # the live state moves on before the writer runs
    report = write_files(tag, topology.rank, files, error=begun.error)
    got = {
        "error": report.error,
        "snapshot_bytes": snapshot.nbytes,
        "deepspeed_clones": len(cloned),
        "snapshot_clones": snapshot._clones,
        "files": {},
    }
    for name in sorted(set(_tag_files(sync.directory, "step00000001")) | set(report.files)):
        a, b = sync.directory / "step00000001" / name, tag / name
        size, digest = report.files.get(name, (None, None))
        got["files"][name] = {
            "equal": a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes(),
            "size": a.stat().st_size if a.is_file() else -1,
            "reported": size,
            "sha256": b.is_file() and digest == chunk_hashes(b),
        }
    return got


@contextlib.contextmanager
def _deepspeeds_own_clones():
    """Counts the calls to DeepSpeed's own `clone_tensors_for_torch_save` from its save paths (each a second
    host copy of a file's tensors besides the snapshot)."""
    from deepspeed.runtime import engine as engine_module
    from deepspeed.runtime.pipe import module as pipe_module

    calls = []
    sites = (engine_module, pipe_module)
    originals = [site.clone_tensors_for_torch_save for site in sites]

    def counted(original):
        def clone(item, device=torch.device("cpu")):
            calls.append(1)
            return original(item, device)

        return clone

    for site, original in zip(sites, originals):
        site.clone_tensors_for_torch_save = counted(original)
    try:
        yield calls
    finally:
        for site, original in zip(sites, originals):
            site.clone_tensors_for_torch_save = original


def _worker(_rank: int, port: int, root: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    from keel.engine.distributed import init_distributed

    init_distributed()
    results = {kind: _compare_kind(kind, Path(root)) for kind in KINDS}
    (Path(root) / "results.json").write_text(json.dumps(results))
    os._exit(0)  # gloo can abort at interpreter exit


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("async_engines")
    start_world(_worker, (free_port(), str(root)), 1)
    return json.loads((root / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_async_files_equal_a_synchronous_saves_byte_for_byte(compared, kind):
    got = compared[kind]
    assert got["error"] == ""
    files = got["files"]
    assert "keel_rng_rank0.pt" in files and any(
        name.endswith("model_states.pt") for name in files
    ), files
    if kind in ("zero1", "zero2", "zero3", "bf16", "moe", "pipeline"):
        assert any("optim_states" in name for name in files), files
    for name, file in files.items():
        assert file["equal"] and file["reported"] == file["size"] and file["sha256"], (name, file)
    # one host copy of the rank's files: where DeepSpeed clones a file's state for torch.save (MoE's files, the
    # pipeline's layer files), it clones into the snapshot's buffers, never first into its own
    assert got["snapshot_bytes"] <= sum(f["size"] for f in files.values())
    assert got["deepspeed_clones"] == 0
    assert (got["snapshot_clones"] > 0) == (kind in ("moe", "pipeline"))


# -- a crash while a writer is paused, then resume (multi-process) ------------------------------------------------
# shared with tests/test_keel_train.py: TINY, 10 steps, saved only at the end
REFERENCE = Run.of("zero0", 2)
KEEL_RUNS = [REFERENCE]


@pytest.mark.slow
@pytest.mark.fault(
    "every rank crashes while rank 1's checkpoint writer is paused mid-save",
    "the save is never published; resume loads the previous one and ends bitwise at the uninterrupted "
    "run's weights",
)
def test_a_crash_during_a_background_write_resumes_bitwise(runs, tmp_path):
    reference = runs.run(REFERENCE)
    run_dir = tmp_path / "crashed"
    common = dict(checkpoint__async_save="true", checkpoint__interval=3)
    # saves at 3 (published before the next), 6 (rank 1 pauses 120 s before renaming its file), crash after step 7
    keel_train(
        run_dir,
        2,
        runs.overrides(
            **common,
            faults__save_stall_rank=1,
            faults__save_stall_s=120,
            faults__save_stall_step=6,
            faults__crash_step=7,
        ),
        expect_code=1,
    )
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text() == "step00000003"
    assert (ckpt / "step00000003" / COMPLETE).is_file() and not (
        ckpt / "step00000006" / COMPLETE
    ).exists()
    # rank 1's writer had written its file aside and was paused before renaming it into place
    assert (ckpt / "step00000006" / ".async_rank1" / "keel_rng_rank1.pt").is_file()
    assert not (ckpt / "step00000006" / "keel_rng_rank1.pt").exists()
    # resumes from step 3, saves 6 (again), 9 and 10
    keel_train(run_dir, 2, runs.overrides(**common))
    assert json.loads((ckpt / "step00000010" / COMPLETE).read_text())["step"] == 10
    assert not (ckpt / "step00000006" / ".async_rank1").exists()
    want, got = final_weights(reference), final_weights(run_dir)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("failed", [True, False])
def test_a_rollback_first_concludes_the_pending_background_save(failed):
    """A rollback waits for the pending background save; one that failed under `on_save_error: stop` stops the
    run there (exit 8) rather than being rolled past, and a good one is published before choosing where to go."""
    from keel.training.guards.base import Action, Decision
    from keel.training.trainer import Trainer, TrainResult

    calls = []

    class Checkpoints:
        def background(self, wait=False, final=False):
            calls.append(("background", wait))
            return (
                Decision(Action.STOP, "checkpoint step00000006 could not be saved", 8)
                if failed
                else Decision()
            )

        def rollback(self, state, rewind, *args):
            calls.append("rollback")
            return TrainState(step=3)

    trainer = object.__new__(Trainer)  # the decision logic alone: no engine
    trainer.cfg, trainer.guards, trainer.checkpoints = (
        build_config({}),
        SimpleNamespace(last_event=None),
        Checkpoints(),
    )
    watchdog = SimpleNamespace(phase=lambda name, timeout: contextlib.nullcontext())
    got = trainer._act(Decision(Action.ROLLBACK, "loss spikes"), TrainState(step=7), None, watchdog)
    if failed:
        assert isinstance(got, TrainResult) and got.exit_code == 8 and not got.finished
        assert calls == [("background", True)]
    else:
        assert got == TrainState(step=3) and calls == [("background", True), "rollback"]
