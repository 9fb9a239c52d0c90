"""Elastic recovery across "nodes": two Linux network namespaces joined by a veth pair, one torchrun agent each.

Node A (10.231.0.1) hosts the c10d rendezvous; node B (10.231.0.2) joins it; one rank per node, gloo between
them over the veth pair. Both addresses exist only inside the two namespaces. Mid-run every process of node B
is SIGKILLed (agent and worker at once, as when a machine dies). Node A's worker sees its collective fail and
exits; A's agent restarts its worker group, re-rendezvouses alone (`--nnodes=1:2`), and Keel resumes from the
latest checkpoint at world size 1 through DeepSpeed's universal conversion, with the global batch kept
(gradient accumulation doubles), so the run continues on exactly the samples an uninterrupted run uses.
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid

import pytest
import torch

from keel.training.observe.metrics import read_metrics
from tests.keel_runs import REPO, Run, last_step_before_restart
from tests.netns import RDZV_PORT, NetnsUnavailable, TwoNodes, node_env, torchrun_cmd

pytestmark = pytest.mark.slow

STEPS, INTERVAL, KILL_AT = 40, 5, 12
KEEL_RUNS = [
    Run.of(
        "elastic-ref", 2, "ds_configs/zero1.json", train__steps=STEPS, checkpoint__interval=INTERVAL
    )
]


def _tail(path, n: int = 6000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else f"({path} missing)"


@pytest.mark.fault(
    "node lost (agent and worker killed)", "survivor re-rendezvouses alone, reshards, same samples"
)
def test_node_loss_shrinks_to_one_node_and_finishes_on_the_same_samples(runs, tmp_path):
    sets = dict(train__steps=STEPS, checkpoint__interval=INTERVAL)
    # also prepares the shared data
    straight = runs.get("elastic-ref", 2, "ds_configs/zero1.json", **sets)
    overrides = runs.overrides(**sets)
    try:
        nodes = TwoNodes().__enter__()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    run_dir, logs = tmp_path / "run", {name: tmp_path / f"node_{name}.log" for name in "ab"}
    run_id = f"keel-netns-{uuid.uuid4().hex[:8]}"
    endpoint = f"{nodes['a'].addr}:{RDZV_PORT}"
    program = [
        "-m",
        "keel.launcher.cli",
        "train",
        "--run-dir",
        str(run_dir),
        "--ds-config",
        str(REPO / "ds_configs" / "zero1.json"),
    ]
    for item in overrides:
        program += ["--set", item]
    files = {}
    try:
        procs = {}
        for name in (
            "b",
            "a",
        ):  # B first: it retries until A's store is up, so the first round has both
            files[name] = open(logs[name], "w")
            cmd = torchrun_cmd(nodes[name], endpoint, run_id, is_host=name == "a", program=program)
            procs[name] = nodes.popen(
                name,
                cmd,
                cwd=REPO,
                env=node_env(nodes[name], REPO),
                stdout=files[name],
                stderr=subprocess.STDOUT,
            )

        def report() -> str:
            return "\n".join(
                f"--- node {n} (exit {procs[n].poll()}) ---\n{_tail(logs[n])}" for n in "ab"
            )

        deadline = time.time() + 300
        while True:
            steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
            if steps and steps[-1] >= KILL_AT:
                break
            assert all(p.poll() is None for p in procs.values()), f"a node exited early\n{report()}"
            assert time.time() < deadline, f"no step {KILL_AT} within 300 s\n{report()}"
            time.sleep(0.1)
        kill_step = steps[-1]
        killed = nodes.kill_all("b")
        assert killed, "node B had no processes to kill"
        try:
            code_a = procs["a"].wait(timeout=600)
        finally:
            for f in files.values():
                f.close()
        log_a = logs["a"].read_text(errors="replace")
        assert code_a == 0, (
            f"node A exited {code_a} after node B was killed at step {kill_step}\n{report()}"
        )

        # the run before the kill had both nodes; the resume ran alone and resharded the 2-rank checkpoint
        saved = re.search(
            r"checkpoint (step\d+) was written at "
            r"\{'world_size': 2, 'dp': 2, 'ep': 1, 'tp': 1, 'pp': 1\}; this run is world=1 ",
            log_a,
        )
        assert saved, f"no universal conversion from world size 2 to 1 in node A's log\n{report()}"
        tag = saved.group(1)
        resumed_step = int(tag.removeprefix("step"))
        assert f"resumed from {tag}: step {resumed_step}" in log_a
        # the kill lands a step or two after the poll saw `kill_step`: bound the resume by what was trained
        reached = last_step_before_restart(run_dir, resumed_step)
        assert kill_step <= reached, (kill_step, reached)
        assert resumed_step <= reached and resumed_step % INTERVAL == 0, (resumed_step, reached)

        # the global batch stayed, so gradient accumulation doubled (micro batch 2: 2 ranks × 2 → 1 rank × 4)
        final = torch.load(
            run_dir / "checkpoints" / f"step{STEPS:08d}" / "mp_rank_00_model_states.pt",
            map_location="cpu",
            weights_only=False,
        )
        ds = final["ds_config"]
        assert (
            final["dp_world_size"],
            ds["train_batch_size"],
            ds["gradient_accumulation_steps"],
        ) == (1, 8, 4)

        records, want = (
            read_metrics(run_dir / "metrics.jsonl"),
            read_metrics(straight / "metrics.jsonl"),
        )
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        batch = int(dict(item.split("=", 1) for item in overrides)["train.global_batch_size"])
        assert [r["consumed_samples"] for r in records] == [r["step"] * batch for r in records]
        assert [r["consumed_samples"] for r in records] == [r["consumed_samples"] for r in want]
        got_loss, want_loss = [r["loss"] for r in records], [r["loss"] for r in want]
        rel = [abs(x - y) / abs(y) for x, y in zip(got_loss, want_loss)]
        print(
            f"\nnode B killed at step {kill_step}; resumed at world size 1 from {tag}; "
            f"max relative loss difference vs the uninterrupted 2-rank run: before the resume "
            f"{max(rel[:resumed_step]):.2e}, after it {max(rel[resumed_step:]):.2e}"
        )
        for step, (x, y, r) in enumerate(zip(got_loss, want_loss, rel), start=1):
            assert r <= 1e-4, f"step {step}: {x} vs {y} (rel {r:.2e})"
    finally:
        nodes.close()
        for f in files.values():
            f.close()
