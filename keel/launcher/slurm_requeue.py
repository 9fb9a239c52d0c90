"""What a `keel slurm` job does when its ranks (or its preflight step) stop: requeue, resubmit without bad
nodes, or end — run by the job's own script (slurm/keel.sbatch), on the batch node, after the ranks exit.

- A node of this allocation is in the run dir's bad-node list (keel/run_dir/bad_nodes.py: preflight, a hang, a
  checksum mismatch, a straggler; the hang suspects are taken from the anomaly log first): the job is submitted
  again, the same script and run dir, with `--exclude` naming every recorded node and `--nodes` the most still
  usable in the partition (down, drained and failing nodes do not count), no fewer than `--min-nodes` and
  one at which the run's layout holds. A running job's node list cannot be changed (`scontrol update` refuses
  ExcNodeList once a job runs), so the job is not requeued in place. Too few nodes left: one line, exit 9.
- Otherwise a preemption (exit 5, or the time limit's USR1) requeues the job in place, as before.
- Otherwise the job ends with the ranks' exit code.

    python -m keel.launcher.slurm_requeue --run-dir DIR --exit-code RC --tasks-per-node T --min-nodes M
        --script DIR/keel.sbatch [--preempted]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from keel.config import ConfigError, validate
from keel.run_dir import ExitCode, RunDir, read_run_dir
from keel.run_dir.bad_nodes import BadNode, BadNodesError, collect

# sinfo's node states a job can be given (with or without a flag character after them: ~ # ! % $ @ ^ - +);
# a `*` (not responding) makes any state unusable
USABLE_STATES = {
    "idle",
    "alloc",
    "allocated",
    "mix",
    "mixed",
    "comp",
    "completing",
    "plnd",
    "planned",
}


def say(line: str, error: bool = False) -> None:
    print(f"keel-slurm: {line}", file=sys.stderr if error else sys.stdout, flush=True)


def hostnames(nodelist: str) -> list[str]:
    """SLURM's compressed node list (node[1-3],gpu7) expanded by SLURM itself."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def partition_nodes(partition: str | None) -> dict[str, bool]:
    """The partition's nodes, each with whether a job can be given it now or later (not down, drained, failing
    or silent)."""
    cmd = ["sinfo", "--noheader", "--Node", "--format=%N %t"]
    if partition:
        cmd.append(f"--partition={partition}")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    nodes: dict[str, bool] = {}
    for line in out.splitlines():
        name, _, state = line.strip().partition(" ")
        state = state.strip()
        usable = not state.endswith("*") and re.sub(r"[~#!%$@^\-+]+$", "", state) in USABLE_STATES
        nodes[name] = nodes.get(name, False) or usable
    return nodes


def node_count(
    run_dir: Path, available: int, wanted: int, minimum: int, tasks_per_node: int
) -> tuple[int | None, str]:
    """The most nodes ≤ min(wanted, available) and ≥ minimum at which the run's layout holds; (None, why) when
    there is none. Without the run's config in the run dir (a script from an older Keel), the ranks check it."""
    if not RunDir(run_dir).config.is_file():
        return (min(wanted, available), "") if min(wanted, available) >= minimum else (None, "")
    cfg = read_run_dir(run_dir)[0]
    last_error = ""
    for nodes in range(min(wanted, available), minimum - 1, -1):
        try:
            validate(cfg, nodes * tasks_per_node)
            return nodes, ""
        except ConfigError as err:
            last_error = f"; at {nodes} node(s): {err}"
    return None, last_error


def resubmit(args: argparse.Namespace, bad: list[BadNode], hit: list[str], nodes_now: int) -> int:
    """A new job without the bad nodes, or exit 9 when too few remain."""
    partition = os.environ.get("SLURM_JOB_PARTITION")
    nodes_here = partition_nodes(partition)
    # every recorded node SLURM knows here, usable now or not (a drained one may come back)
    excluded = [h for h in dict.fromkeys(n.host for n in bad) if h in nodes_here]
    left = [n for n, usable in nodes_here.items() if usable and n not in excluded]
    why = ", ".join(
        f"{h} ({'; '.join(sorted({n.reason for n in bad if n.host == h}))})" for h in hit
    )
    nodes, invalid = node_count(
        args.run_dir, len(left), nodes_now, args.min_nodes, args.tasks_per_node
    )
    if nodes is None:
        say(
            f"bad node(s) {why}: too few nodes remain: {len(left)} usable in partition "
            f"{partition or '(default)'} without the {len(excluded)} recorded in "
            f"{args.run_dir}/bad_nodes.json, the job needs at least {args.min_nodes} "
            f"(--min-nodes){invalid}; free nodes, or remove entries from bad_nodes.json to give nodes back",
            error=True,
        )
        return ExitCode.PREFLIGHT
    cmd = ["sbatch", "--parsable", f"--nodes={nodes}", str(args.script)]
    if excluded:
        cmd.insert(2, f"--exclude={','.join(excluded)}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        say(
            f"bad node(s) {why}: resubmitting without them failed: {(proc.stderr or proc.stdout).strip()}; "
            f"submit again with the same run dir (keel slurm excludes them)",
            error=True,
        )
        return args.exit_code or 1
    job = proc.stdout.strip().split(";")[0]
    say(
        f"bad node(s) {why}: resubmitted as job {job} on {nodes} node(s), excluding "
        f"{','.join(excluded) or 'none'}; it resumes from {args.run_dir}"
    )
    return ExitCode.OK


def requeue_in_place(job_id: str, exit_code: int) -> int:
    say(f"requeueing job {job_id}; it resumes from the latest checkpoint")
    if subprocess.run(["scontrol", "requeue", job_id]).returncode == 0:
        return ExitCode.OK
    say("scontrol requeue failed; resume by submitting again with the same run dir", error=True)
    return exit_code


def decide(args: argparse.Namespace) -> int:
    job_id = os.environ["SLURM_JOB_ID"]
    try:
        bad = collect(args.run_dir)
    except BadNodesError as err:
        say(str(err), error=True)
        bad = []
    allocation = hostnames(os.environ["SLURM_JOB_NODELIST"])
    recorded = {n.host for n in bad}
    hit = [h for h in allocation if h in recorded]
    if hit:
        return resubmit(args, bad, hit, len(allocation))
    if args.exit_code == ExitCode.PREEMPTED or args.preempted:
        return requeue_in_place(job_id, args.exit_code)
    if args.exit_code != ExitCode.PREFLIGHT:  # preflight's own line says why
        say(f"training failed with exit code {args.exit_code}; see the log above", error=True)
    return args.exit_code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--exit-code", type=int, required=True, help="the ranks' (or preflight's)")
    p.add_argument("--tasks-per-node", type=int, required=True)
    p.add_argument("--min-nodes", type=int, required=True)
    p.add_argument("--script", type=Path, required=True, help="the job's sbatch script")
    p.add_argument("--preempted", action="store_true", help="the time limit's USR1 came")
    return decide(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
