"""Storage faults around checkpoints: corrupt or truncated files, a full disk in the middle of a save.

The one-process cases drive Keel's real Checkpointer around a fake engine that writes through DeepSpeed's own
TorchCheckpointEngine (the seam Keel routes each write through); one process is rank 0 and the only verifier.
The multi-process case at the end is the issue's: real ranks, ZeRO-1, a corrupt optimizer shard on resume, and a
disk that fills inside DeepSpeed's shard write under both `checkpoint.on_save_error` policies — three runs in one
launch.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keel.config import ConfigError, FaultsConfig, load_config, validate
from keel.launcher.run_spec import build_run, prepare_data, write_run_dir
from keel.parallel.topology import Topology
from keel.run_dir import COMPLETE, AnomalyLog, ExitCode, read_anomalies, tag_for
from keel.training.checkpoint import verify
from keel.training.checkpoint.save_failures import after_failed_save
from keel.training.checkpoint.store import Checkpointer, NoIntactCheckpoint, SaveOutcome, TrainState
from keel.training.checkpoint.verify import shares
from keel.training.faults import FaultInjector
from keel.training.observe.metrics import read_metrics
from tests.keel_runs import REPO, Run, copy_run, final_weights
from tests.test_checkpoint import FakeEngine as OneFileEngine
from tests.test_recovery import RESTART

SHARD = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


class FakeEngine(OneFileEngine):
    """Writes a model file and an optimizer shard where DeepSpeed would, through DeepSpeed's checkpoint engine."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        path = Path(save_dir) / tag
        self.checkpoint_engine.makedirs(str(path), exist_ok=True)
        step = client_state["keel"]["step"]
        self.checkpoint_engine.save(
            {"module": {"w": torch.full((64,), float(step))}, **client_state}, str(path / MODEL)
        )
        self.checkpoint_engine.save(
            {"state": torch.arange(65536, dtype=torch.float32) * step}, str(path / SHARD)
        )
        self._copy_recovery_script(save_dir)


def checkpointer(directory: Path, keep_last: int = 3) -> Checkpointer:
    return Checkpointer(
        directory / "checkpoints", keep_last, Topology.from_env(), AnomalyLog(directory, 0)
    )


def reopened(ckpt: Checkpointer) -> Checkpointer:
    """The same checkpoints as a new process sees them (nothing verified yet)."""
    return Checkpointer(ckpt.directory, ckpt.keep_last, ckpt.topology, ckpt.anomalies)


def saved(tmp_path: Path, steps=(10, 20), keep_last: int = 3) -> Checkpointer:
    ckpt = checkpointer(tmp_path, keep_last)
    for step in steps:
        assert ckpt.save(FakeEngine(), TrainState(step=step, consumed_samples=8 * step)).ok
    return ckpt


def flip(path: Path, offset: int, length: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + length] = bytes(b ^ 0xFF for b in data[offset : offset + length])
    path.write_bytes(bytes(data))


def corrupt_events(run_dir: Path) -> list[dict]:
    return [e for e in read_anomalies(run_dir) if e["kind"] == "checkpoint_corrupt"]


def test_manifest_hashes_equal_the_files_on_disk(tmp_path):
    """The writer's own digests (hashed as each file closed) describe the bytes on disk."""
    ckpt = saved(tmp_path, steps=(10,))
    manifest = ckpt.read_manifest("step00000010")
    tag_dir = ckpt.directory / "step00000010"
    assert set(manifest["files"]) == {MODEL, SHARD, "keel_rng_rank0.pt"}
    step = manifest["chunk_bytes"]
    for name, size in manifest["files"].items():
        data = (tag_dir / name).read_bytes()
        chunks = [data[i : i + step] for i in range(0, max(1, len(data)), step)]
        assert size == len(data)
        assert manifest["sha256_chunks"][name] == [hashlib.sha256(c).hexdigest() for c in chunks]


@pytest.mark.fault(
    "checkpoint shard cut short (manifest present)",
    "recorded, set aside as .corrupt, previous loaded",
)
def test_truncated_shard_is_set_aside_and_the_previous_checkpoint_agreed(tmp_path):
    ckpt = saved(tmp_path)
    shard = ckpt.directory / "step00000020" / SHARD
    shard.write_bytes(shard.read_bytes()[:1000])
    assert ckpt.agreed_latest() == "step00000010"
    assert (ckpt.directory / "latest").read_text() == "step00000010"
    assert (ckpt.directory / "step00000020.corrupt" / SHARD).stat().st_size == 1000  # kept as found
    [event] = corrupt_events(tmp_path)
    assert (event["checkpoint"], event["file"], event["step"]) == ("step00000020", SHARD, 20)
    assert "1000 bytes, the manifest says" in event["reason"]


@pytest.mark.fault(
    "checkpoint bytes flipped (same size)", "sha256 mismatch: set aside, previous loaded"
)
def test_flipped_bytes_are_found_by_their_hash(tmp_path):
    ckpt = saved(tmp_path)
    flip(ckpt.directory / "step00000020" / SHARD, 100_000)
    assert ckpt.agreed_latest() == "step00000010"
    [event] = corrupt_events(tmp_path)
    assert event["file"] == SHARD and "sha256 differs" in event["reason"]


@pytest.mark.fault("a rank's checkpoint file missing", "set aside, previous loaded")
def test_missing_rank_file_is_corruption(tmp_path):
    ckpt = saved(tmp_path)
    (ckpt.directory / "step00000020" / "keel_rng_rank0.pt").unlink()
    assert ckpt.agreed_latest() == "step00000010"
    assert [(e["file"], e["reason"]) for e in corrupt_events(tmp_path)] == [
        ("keel_rng_rank0.pt", "missing")
    ]


@pytest.mark.fault("garbled checkpoint manifest", "set aside, previous loaded")
def test_garbled_manifest_is_corruption(tmp_path):
    ckpt = saved(tmp_path)
    manifest = ckpt.directory / "step00000020" / COMPLETE
    manifest.write_text(manifest.read_text()[:-40])
    assert ckpt.latest_tag() == "step00000020"
    assert ckpt.agreed_latest() == "step00000010"
    [event] = corrupt_events(tmp_path)
    assert event["file"] == COMPLETE and "not valid JSON" in event["reason"]


@pytest.mark.fault("rollback target checkpoint corrupt", "set aside, the one before it loaded")
def test_rollback_goes_past_a_corrupt_checkpoint_and_latest_stays(tmp_path):
    ckpt = saved(tmp_path, steps=(10, 20, 30))
    flip(ckpt.directory / "step00000020" / MODEL, 200)
    assert ckpt.agreed_at_or_before(29) == "step00000010"
    # it named a good one: left alone
    assert (ckpt.directory / "latest").read_text() == "step00000030"
    assert ckpt.complete_tags() == ["step00000010", "step00000030"]


def test_old_manifest_without_hashes_loads_by_size(tmp_path):
    ckpt = saved(tmp_path)
    for tag in ("step00000010", "step00000020"):  # as written before hashes were recorded
        path = ckpt.directory / tag / COMPLETE
        manifest = json.loads(path.read_text())
        del manifest["sha256_chunks"], manifest["chunk_bytes"]
        path.write_text(json.dumps(manifest))
    flip(ckpt.directory / "step00000020" / SHARD, 100_000)  # same size: an old manifest cannot tell
    assert ckpt.agreed_latest() == "step00000020"
    shard = ckpt.directory / "step00000020" / SHARD
    shard.write_bytes(
        shard.read_bytes()[:-1]
    )  # a size it can (a new process: this one verified it)
    assert reopened(ckpt).agreed_latest() == "step00000010"


def test_old_manifest_with_whole_file_hashes_still_verifies(tmp_path):
    """Manifests before chunk hashes recorded one sha256 per file: still checked, one piece per file."""
    ckpt = saved(tmp_path)
    for tag in ("step00000010", "step00000020"):
        path = ckpt.directory / tag / COMPLETE
        manifest = json.loads(path.read_text())
        del manifest["sha256_chunks"], manifest["chunk_bytes"]
        manifest["sha256"] = {
            n: hashlib.sha256((path.parent / n).read_bytes()).hexdigest() for n in manifest["files"]
        }
        path.write_text(json.dumps(manifest))
    flip(ckpt.directory / "step00000020" / SHARD, 100_000)
    assert ckpt.agreed_latest() == "step00000010"
    [event] = corrupt_events(tmp_path)
    assert event["reason"] == "sha256 differs from the manifest's (same size: bytes changed)"


def test_a_large_file_is_verified_in_chunks_shared_by_the_ranks(tmp_path):
    """Each chunk of a file is a piece of work of its own: one large file spreads over every rank, and a flipped
    byte is found by the rank holding its chunk, which names the bytes."""
    path = tmp_path / "stage.pt"
    path.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes, 11 chunks of 1,000
    manifest = {
        "files": {path.name: 10_240},
        "chunk_bytes": 1000,
        "sha256_chunks": {path.name: verify.chunk_hashes(path, 1000)},
    }
    files = verify.manifest_files(manifest)
    work = verify.pieces(files)
    assert len(work) == 11 and sum(work.values()) == 10_240
    parts = verify.shares(work, 4)
    assert sorted(p for part in parts for p in part) == sorted(work)
    assert [len(part) for part in parts] == [3, 3, 3, 2]
    assert all(verify.verify(tmp_path, files, part) == [] for part in parts)
    flip(path, 4321, length=1)
    found = [verify.verify(tmp_path, files, part) for part in parts]
    assert sum(map(bool, found)) == 1
    assert [f for f in found if f] == [
        [
            (
                path.name,
                "sha256 differs from the manifest's in bytes 4000-5000 (same size: bytes changed)",
            )
        ]
    ]
    manifest["sha256_chunks"][path.name] = manifest["sha256_chunks"][path.name][:-1]
    with pytest.raises(ValueError, match="lists 10 chunk hashes"):
        verify.manifest_files(manifest)


def test_a_checkpoint_verified_here_is_not_verified_again_until_written(tmp_path, monkeypatch):
    """A rollback to a tag this process verified (and has not written since) reads nothing again."""
    ckpt = saved(tmp_path, steps=(10, 20))
    checked = []
    real = verify.verify
    monkeypatch.setattr(
        verify, "verify", lambda *a, **k: checked.append(a[0].name) or real(*a, **k)
    )
    assert ckpt.agreed_latest() == "step00000020" and ckpt.agreed_at_or_before(25) == "step00000020"
    assert ckpt.agreed_at_or_before(15) == "step00000010"
    assert checked == ["step00000020", "step00000010"]
    ckpt.save(FakeEngine(), TrainState(step=20))  # written again: verified again
    assert ckpt.agreed_latest() == "step00000020" and checked[-1] == "step00000020"
    assert len(checked) == 3


@pytest.mark.fault("every checkpoint corrupt", "stop with one line, exit 6, none deleted")
def test_every_checkpoint_corrupt_stops_instead_of_starting_over(tmp_path):
    ckpt = saved(tmp_path)
    for tag in ("step00000010", "step00000020"):
        flip(ckpt.directory / tag / SHARD, 50_000)
    with pytest.raises(NoIntactCheckpoint) as err:
        ckpt.agreed_latest()
    assert err.value.exit_code == ExitCode.CHECKPOINT and "\n" not in str(err.value)
    assert "step00000020, step00000010 set aside" in str(err.value)
    assert sorted(p.name for p in ckpt.directory.iterdir()) == [
        "step00000010.corrupt",
        "step00000020.corrupt",
        "zero_to_fp32.py",  # DeepSpeed's, beside the checkpoints
    ]
    # set-aside checkpoints are not checkpoints: never chosen, never pruned by later saves
    for step in (30, 40):
        ckpt.save(FakeEngine(), TrainState(step=step))
    assert ckpt.agreed_latest() == "step00000040"
    ckpt_keep1 = checkpointer(tmp_path, keep_last=1)
    ckpt_keep1.save(FakeEngine(), TrainState(step=50))
    assert sorted(p.name for p in ckpt.directory.iterdir() if p.is_dir()) == [
        "step00000010.corrupt",
        "step00000020.corrupt",
        "step00000050",
    ]


def test_shares_balance_bytes_and_cover_every_file_once():
    sizes = {f"zero_pp_rank_{r}_optim_states.pt": 1000 + r for r in range(8)} | {
        "model.pt": 3000,
        "rng.pt": 10,
    }
    parts = shares(sizes, 4)
    assert sorted(n for part in parts for n in part) == sorted(sizes)
    loads = [sum(sizes[n] for n in part) for part in parts]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert shares(sizes, 4) == parts  # every rank computes the same split
    assert shares({"a": 5}, 3) == [["a"], [], []]


# -- disk full during a save ------------------------------------------------------------------------------------------
def assert_intact(ckpt: Checkpointer, tag: str) -> None:
    """`latest` names `tag`, it verifies, and every file in it loads."""
    assert (ckpt.directory / "latest").read_text() == tag and ckpt.agreed_latest() == tag
    for name in ckpt.read_manifest(tag)["files"]:
        torch.load(ckpt.directory / tag / name, weights_only=False)


@pytest.mark.fault(
    "disk full inside DeepSpeed's shard write (injected ENOSPC)",
    "save discarded on every rank, previous checkpoint stays latest",
)
def test_disk_full_mid_shard_discards_the_save_and_keeps_the_previous(tmp_path):
    # keep_last=1: a committed save would prune step 10
    ckpt = saved(tmp_path, steps=(10,), keep_last=1)
    outcome = ckpt.save(FakeEngine(), TrainState(step=20), disk_room=200)
    assert not outcome.ok and outcome.tag == "step00000020"
    assert outcome.error.startswith(
        f"rank 0: writing {ckpt.directory / 'step00000020' / MODEL}: [Errno 28]"
    )
    assert not (ckpt.directory / "step00000020").exists()  # the half-written directory is removed
    assert_intact(ckpt, "step00000010")
    assert ckpt.save(FakeEngine(), TrainState(step=30)).ok  # the next interval saves
    assert ckpt.complete_tags() == ["step00000030"]


@pytest.mark.fault(
    "disk full while rank 0 writes the manifest", "save discarded, previous checkpoint stays latest"
)
def test_disk_full_at_the_commit_discards_the_save(tmp_path, monkeypatch):
    import keel.training.checkpoint.store as checkpoint

    ckpt = saved(tmp_path, steps=(10,), keep_last=1)
    write = checkpoint.write_atomic

    def full_at_manifest(path: Path, text: str) -> None:
        if path.name == COMPLETE:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, text)

    monkeypatch.setattr(checkpoint, "write_atomic", full_at_manifest)
    outcome = ckpt.save(FakeEngine(), TrainState(step=20))
    assert outcome.error == "rank 0: committing step00000020: [Errno 28] No space left on device"
    monkeypatch.undo()
    assert not (ckpt.directory / "step00000020").exists()
    assert_intact(ckpt, "step00000010")


def test_the_disk_fault_fires_on_its_rank_and_step():
    class Engine:
        module = torch.nn.Linear(2, 2)

    cfg = FaultsConfig(save_enospc_rank=1, save_enospc_step=10, save_enospc_bytes=123)
    assert [
        FaultInjector(cfg, rank, Engine(), 8, 0).disk_room(step)
        for rank, step in [(1, 10), (1, 5), (0, 10)]
    ] == [123, None, None]
    every = FaultsConfig(save_enospc_rank=0, save_enospc_step=0)
    assert FaultInjector(every, 0, Engine(), 8, 0).disk_room(7) == 4096


def test_the_injected_disk_writes_its_bytes_then_fails(tmp_path):
    """N bytes reach the file before ENOSPC, as on a filesystem that fills mid-write."""
    from keel.training.checkpoint.writes import FullDisk

    with FullDisk(tmp_path / "f", 10) as f:
        assert f.write(b"0123456789abc") == 10
        with pytest.raises(OSError) as err:
            f.write(b"x")
    assert err.value.errno == errno.ENOSPC and (tmp_path / "f").read_bytes() == b"0123456789"


@pytest.mark.fault(
    "a real full device (/dev/full) under a shard",
    "save discarded, previous checkpoint stays latest",
)
def test_real_dev_full_write_is_kept_on_the_rank(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    ckpt = saved(tmp_path, steps=(10,), keep_last=1)
    tag_dir = ckpt.directory / "step00000020"
    tag_dir.mkdir()
    # DeepSpeed's own open() of the shard lands on a full device
    (tag_dir / SHARD).symlink_to("/dev/full")
    outcome = ckpt.save(FakeEngine(), TrainState(step=20))
    assert "[Errno 28] No space left on device" in outcome.error, outcome.error
    assert not tag_dir.exists() and os.path.exists("/dev/full")
    assert_intact(ckpt, "step00000010")


@pytest.mark.parametrize(
    "policy, final, stops",
    [("continue", False, False), ("stop", False, True), ("continue", True, True)],
)
def test_on_save_error_policy(tmp_path, policy, final, stops):
    outcome = SaveOutcome(tag_for(20), "rank 1: writing x: [Errno 28] No space left on device")
    reason = after_failed_save(
        outcome, policy, final, 20, AnomalyLog(tmp_path, 0), 0, previous=tag_for(10)
    )
    assert bool(reason) == stops and "\n" not in reason
    if stops:
        assert f"exit code {ExitCode.SAVE_FAILED}" in reason and "No space left" in reason
        assert reason.endswith("the previous checkpoint step00000010 is intact and stays latest")
    [event] = read_anomalies(tmp_path)
    assert (event["kind"], event["action"], event["latest"]) == (
        "checkpoint_save_failed",
        "stop" if stops else "continue",
        tag_for(10),
    )
    first = after_failed_save(outcome, "stop", final, 2, AnomalyLog(tmp_path, 0), 0, None)
    assert first.endswith("the run has no complete checkpoint yet")


def test_on_save_error_is_validated():
    cfg = load_config(None, ["checkpoint.on_save_error=halt"])
    with pytest.raises(
        ConfigError, match="checkpoint.on_save_error: expected continue or stop, got 'halt'"
    ):
        validate(cfg, world_size=1)


# -- the case, with real ranks ---------------------------------------------------------------------------------
ZERO1 = "ds_configs/zero1.json"
TO_20 = {
    **RESTART,
    "train__exit_after": 20,
}  # restart-ref's run, stopped at step 20: checkpoints 10, 15, 20
KEEL_RUNS = [Run.of("restart-ref", 2, ZERO1, **RESTART), Run.of("restart-to-20", 2, ZERO1, **TO_20)]
CORRUPT_SHARD = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
DISK_FULL = dict(
    train__steps=15, checkpoint__interval=5, faults__save_enospc_rank=1, faults__save_enospc_step=10
)


@pytest.fixture(scope="module")
def faulted(runs, tmp_path_factory) -> dict:
    """One 2-rank launch of three run dirs: restart-to-20 resumed after 4 KiB of rank 1's optimizer shard in step
    20 were flipped; then fresh runs whose rank 1's disk fills inside DeepSpeed's step-10 shard write, under
    on_save_error continue and stop."""
    root = tmp_path_factory.mktemp("checkpoint-faults")
    corrupt = copy_run(runs.get("restart-to-20", 2, ZERO1, **TO_20), root / "corrupt")
    shard = corrupt / "checkpoints" / "step00000020" / CORRUPT_SHARD
    flip(shard, shard.stat().st_size // 2)
    flipped = shard.read_bytes()
    dirs = {"corrupt": corrupt}
    for policy in ("continue", "stop"):
        dirs[policy] = root / policy
        spec = build_run(
            None,
            runs.overrides(**DISK_FULL, checkpoint__on_save_error=policy),
            str(REPO / ZERO1),
            str(dirs[policy]),
            2,
        )
        prepare_data(spec)
        write_run_dir(spec)
    code = (
        "import sys; from pathlib import Path; from keel.launcher.local import launch_local; "
        "sys.exit(launch_local([Path(d) for d in sys.argv[1:]], 2))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, dirs.values())],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    return {"proc": proc, "flipped": flipped, **dirs}


@pytest.mark.slow
@pytest.mark.fault(
    "4 KiB flipped in a rank's ZeRO-1 optimizer shard, then resume",
    "checkpoint_corrupt recorded, set aside, previous one loaded: same final weights",
)
def test_resume_from_a_corrupt_checkpoint_takes_the_previous_one(faulted, runs):
    run, out = faulted["corrupt"], faulted["proc"].stdout
    assert "finished" in (run / "summary.md").read_text(), (
        out[-3000:] + faulted["proc"].stderr[-3000:]
    )
    [event] = corrupt_events(run)
    assert (event["checkpoint"], event["file"]) == (
        "step00000020",
        CORRUPT_SHARD,
    ) and "sha256" in event["reason"]
    assert f"checkpoint step00000020 is corrupt: {CORRUPT_SHARD}: sha256 differs" in out
    assert "resumed from step00000015: step 15" in out
    kept = run / "checkpoints" / "step00000020.corrupt" / CORRUPT_SHARD
    assert kept.read_bytes() == faulted["flipped"]  # set aside as found, never deleted or pruned
    assert "finished" in (run / "summary.md").read_text()
    straight = final_weights(runs.get("restart-ref", 2, ZERO1, **RESTART))
    got = final_weights(run)
    assert got.keys() == straight.keys() and all(torch.equal(got[k], straight[k]) for k in got)


def disk_full_checks(run: Path, action: str) -> dict:
    [event] = [e for e in read_anomalies(run) if e["kind"] == "checkpoint_save_failed"]
    assert (event["step"], event["checkpoint"], event["action"]) == (10, "step00000010", action)
    assert event["error"].startswith(
        f"rank 1: writing {run / 'checkpoints' / 'step00000010' / CORRUPT_SHARD}: "
        "[Errno 28] No space left on device"
    ), event["error"]
    assert not (run / "checkpoints" / "step00000010").exists()
    return event


@pytest.mark.slow
@pytest.mark.fault(
    "disk full inside DeepSpeed's shard write, on_save_error: continue",
    "warned and recorded, save discarded, the next interval saves",
)
def test_disk_full_during_a_save_continues_by_default(faulted):
    run = faulted["continue"]
    assert "finished" in (run / "summary.md").read_text(), faulted["proc"].stdout[-3000:]
    disk_full_checks(run, "continue")
    ckpt = Checkpointer(run / "checkpoints", 3, Topology.from_env())
    assert (
        ckpt.complete_tags() == ["step00000005", "step00000015"]
        and ckpt.latest_tag() == "step00000015"
    )
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, 16))
    assert "finished" in (run / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.fault(
    "disk full inside DeepSpeed's shard write, on_save_error: stop",
    "one line, exit 8; previous checkpoint intact and latest",
)
def test_disk_full_during_a_save_stops_cleanly_when_asked(faulted):
    run, out = faulted["stop"], faulted["proc"].stdout
    assert faulted["proc"].returncode == ExitCode.SAVE_FAILED, (
        out[-3000:] + faulted["proc"].stderr[-3000:]
    )
    disk_full_checks(run, "stop")
    lines = [line for line in out.splitlines() if "could not be saved" in line]
    # every rank, alike
    assert len(lines) == 2 and len({line.split("] ", 1)[1] for line in lines}) == 1, lines
    assert (
        "[keel r0] stopping at step 10: checkpoint step00000010 could not be saved (rank 1: writing"
        in out
    )
    assert f"exit code {ExitCode.SAVE_FAILED}" in (run / "summary.md").read_text()
    assert_intact(Checkpointer(run / "checkpoints", 3, Topology.from_env()), "step00000005")
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, 11))
