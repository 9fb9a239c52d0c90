"""In-memory checkpoints across "nodes" (checkpoint.memory_interval): two network namespaces, one torchrun agent
and one rank each, a fixed two-node job (`--nnodes=2`: a lost node must be replaced before it goes on).

Node B dies past the last disk checkpoint (every process SIGKILLed) and its memory with it (the namespaces share
the host's memory, so its snapshots are removed by hand); a new agent on B replaces it. The job restarts and
restores the in-memory step — B's rank from the copy its buddy on A holds — losing fewer steps than a disk restore
would. Later B dies again and this time both copies of one rank are gone: the restart says so and restores from
disk. The run ends bitwise equal to the uninterrupted one.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import uuid

import pytest
import torch

from keel.training.observe.metrics import read_metrics
from tests.keel_runs import REPO, Run, last_step_before_restart
from tests.netns import RDZV_PORT, NetnsUnavailable, TwoNodes, node_env, torchrun_cmd

pytestmark = pytest.mark.slow

STEPS, DISK, MEMORY = 30, 10, 2
FIRST_KILL, SECOND_KILL = 13, 23  # past a disk checkpoint (10, 20), before the next
SETS = dict(train__steps=STEPS, checkpoint__interval=DISK)
KEEL_RUNS = [Run.of("memory-ref", 2, "ds_configs/zero1.json", **SETS)]


def _tail(path, n: int = 5000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else f"({path} missing)"


def _model_states(run_dir) -> dict[str, torch.Tensor]:
    saved = torch.load(
        run_dir / "checkpoints" / f"step{STEPS:08d}" / "mp_rank_00_model_states.pt",
        map_location="cpu",
        weights_only=False,
    )
    return saved["module"]


@pytest.mark.fault(
    "node lost with its memory, past the last disk checkpoint",
    "replaced node's rank restores the in-memory step from its buddy's copy; bitwise",
)
@pytest.mark.fault(
    "node lost with both copies of a rank's snapshot", "restores from disk and says so; bitwise"
)
def test_a_lost_node_restores_from_its_buddy_copy_and_falls_back_to_disk(runs, tmp_path):
    straight = runs.get("memory-ref", 2, "ds_configs/zero1.json", **SETS)
    memory_dir = tmp_path / "shm"
    overrides = runs.overrides(
        **SETS, checkpoint__memory_interval=MEMORY, checkpoint__memory_dir=str(memory_dir)
    )
    try:
        nodes = TwoNodes().__enter__()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    run_dir = tmp_path / "run"
    rdzv = f"keel-memory-{uuid.uuid4().hex[:8]}"
    endpoint = f"{nodes['a'].addr}:{RDZV_PORT}"
    program = ["-m", "keel.launcher.cli", "train", "--run-dir", str(run_dir)]
    program += ["--ds-config", str(REPO / "ds_configs" / "zero1.json")]
    for item in overrides:
        program += ["--set", item]
    logs, files, procs = {}, [], {}

    def start(name: str, attempt: int) -> None:
        logs[name, attempt] = tmp_path / f"node_{name}_{attempt}.log"
        files.append(open(logs[name, attempt], "w"))
        cmd = torchrun_cmd(nodes[name], endpoint, rdzv, name == "a", program, nnodes="2")
        procs[name] = nodes.popen(
            name,
            cmd,
            cwd=REPO,
            env=node_env(nodes[name], REPO),
            stdout=files[-1],
            stderr=subprocess.STDOUT,
        )

    def report() -> str:
        return "\n".join(f"--- {key} ---\n{_tail(path)}" for key, path in logs.items())

    def reach(step: int) -> int:
        deadline = time.time() + 300
        while True:
            steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
            if steps and steps[-1] >= step:
                return steps[-1]
            assert procs["a"].poll() is None, f"node A exited early\n{report()}"
            assert time.time() < deadline, f"no step {step} within 300 s\n{report()}"
            time.sleep(0.05)

    def node_memory(name: str):
        return next(memory_dir.glob(f"keel-*/node-{name}"))

    try:
        start("b", 0)  # B first: it retries until A's store is up
        start("a", 0)
        killed_at = reach(FIRST_KILL)
        assert nodes.kill_all("b"), "node B had no processes to kill"
        shutil.rmtree(node_memory("b"))  # B's memory went with it
        start("b", 1)  # a replacement node joins the job
        second = reach(SECOND_KILL)
        assert nodes.kill_all("b")
        shutil.rmtree(node_memory("b"))
        for copy in node_memory("a").glob("copy-*"):  # and A's copy of B's rank
            copy.unlink()
        start("b", 2)
        assert procs["a"].wait(timeout=600) == 0, report()
        assert procs["b"].wait(timeout=120) == 0, report()
    finally:
        nodes.close()
        for f in files:
            f.close()
    text = "\n".join(_tail(path, 10**7) for path in logs.values())

    # the first restart: the newest even step at or before the kill, from memory, one rank from a copy
    found = re.findall(
        r"resumed from the in-memory snapshot of step (\d+) .*?\((\d) rank\(s\) from their node's memory, "
        r"(\d) from a copy on another node",
        text,
    )
    assert found, f"no in-memory restore after node B was lost at step {killed_at}\n{report()}"
    step, local, copied = (int(v) for v in found[0])
    # the kill lands a step or two after the poll saw `killed_at`: bound the restored step by what was trained
    reached = last_step_before_restart(run_dir, step)
    assert killed_at <= reached, (killed_at, reached)
    assert DISK < step <= reached and step % MEMORY == 0, (step, killed_at, reached)
    assert (local, copied) == (1, 1), found
    print(
        f"\nnode B lost after step {reached}: restored step {step} from memory "
        f"({reached - step} step(s) re-done; from disk: {reached - DISK})"
    )
    # the second: one rank's snapshot is nowhere, so disk — and the log says why
    assert re.search(
        r"in-memory snapshots: step \d+ is held for 1 of 2 ranks.*restoring from disk", text
    ), report()
    assert f"resumed from step{2 * DISK:08d}: step {2 * DISK}" in text, report()
    assert second >= SECOND_KILL

    # bitwise the uninterrupted run: every step's loss and the final weights
    got, want = read_metrics(run_dir / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    final, reference = _model_states(run_dir), _model_states(straight)
    assert final.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), name
    # a finished run leaves no snapshots behind
    assert not list(memory_dir.glob("keel-*/*/*.pt")), list(memory_dir.rglob("*"))
