"""`keel slurm`: render an sbatch script from `slurm/keel.sbatch` and submit it.

Layout: one SLURM task per rank. `srun --ntasks-per-node=T` starts T tasks on each node and every task runs
`keel train ... --run-dir DIR` in place (RANK=$SLURM_PROCID, WORLD_SIZE=$SLURM_NTASKS,
LOCAL_RANK=$SLURM_LOCALID), so a signal for the job step reaches every rank directly, with no agent between.
MASTER_ADDR is the allocation's first node (its NodeAddr when the name does not resolve), MASTER_PORT is
20000 + job id % 20000, so parallel and requeued jobs do not collide. No ssh.

Preemption: the script asks SLURM for USR1 `--signal-lead` seconds before the time limit and forwards it to
the ranks; `scancel --signal=USR1 JOBID` reaches them directly. Every rank stops after its current step, a
checkpoint is saved, and the ranks exit with ExitCode.PREEMPTED (5); the script then runs `scontrol requeue`, and
the requeued job resumes from that checkpoint because the run dir is the same.

With `--preflight` the job's first srun step is `keel preflight` on the same tasks (keel/tools/preflight/): a bad node
(exit 9, its ranks named in the log and in RUN_DIR/preflight.json) or a failed preflight stops the job with one
line before training starts; on a requeue it runs again, as the job may land on other nodes.

Bad nodes (keel/run_dir/bad_nodes.py) recorded in the run dir are passed to `--exclude`; when a node of a
running job is found bad, the job's script submits it again without that node (keel/launcher/slurm_requeue.py),
on as many nodes as remain usable and no fewer than `--min-nodes`.

Before submitting, the config is checked for nodes × tasks-per-node ranks and the data is prepared here (the
ranks find it in `data.cache_dir`, which must therefore be on a filesystem every node shares, like the run dir).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import string
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from keel.config import ConfigError
from keel.run_dir import ExitCode
from keel.run_dir.bad_nodes import bad_hosts

TEMPLATE = "slurm/keel.sbatch"
SCRIPT_NAME = "keel.sbatch"
PORT_BASE, PORT_SPAN = 20000, 20000
DEFAULT_SIGNAL_LEAD = 300  # seconds before the time limit: finish a step and save a checkpoint


class SubmitError(RuntimeError):
    """sbatch is missing or refused the job (not a mistake in the run's config)."""


class SbatchTemplate(string.Template):
    """`{{ name }}` placeholders, so the template's bash `$VAR` and `${VAR}` stay as they are."""

    delimiter = "{{"
    pattern = r"""
        \{\{(?:
            (?P<escaped>(?!))|
            (?P<named>(?!))|
            \s*(?P<braced>[a-z_][a-z0-9_]*)\s*\}\}|
            (?P<invalid>)
        )"""


@dataclass
class SbatchOptions:
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    signal_lead: int = DEFAULT_SIGNAL_LEAD
    extra: tuple[str, ...] = ()
    # the fewest nodes a resubmission without bad nodes may run on (None: `nodes`, never fewer)
    min_nodes: int | None = None
    exclude: tuple[str, ...] = ()  # nodes recorded bad in the run dir, left out from the start


def parse_time_limit(value: str) -> int:
    """SLURM's --time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds."""
    text = value.strip()
    if text.lower() in ("infinite", "unlimited"):
        return 0
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise ConfigError(
            f"--time: {value!r} is not a SLURM time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)"
        )
    days, a, b, c = match.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, m, s = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + s
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def _sbatch_safe(name: str, value: str) -> str:
    """#SBATCH lines are not parsed by a shell: no quoting, so no whitespace or newlines."""
    if not value or re.search(r"\s", value):
        raise ConfigError(
            f"{name}: {value!r} must be non-empty and contain no whitespace (it goes on an #SBATCH "
            "line)"
        )
    return value


def check_options(opts: SbatchOptions) -> None:
    for name, value in (("--nodes", opts.nodes), ("--tasks-per-node", opts.tasks_per_node)):
        if value < 1:
            raise ConfigError(f"{name}: must be >= 1, got {value}")
    if opts.min_nodes is not None and not 1 <= opts.min_nodes <= opts.nodes:
        raise ConfigError(f"--min-nodes: must be 1..--nodes ({opts.nodes}), got {opts.min_nodes}")
    if opts.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node: must be >= 0, got {opts.gpus_per_node}")
    if opts.cpus_per_task is not None and opts.cpus_per_task < 1:
        raise ConfigError(f"--cpus-per-task: must be >= 1, got {opts.cpus_per_task}")
    if not 0 < opts.signal_lead <= 65535:
        raise ConfigError(f"--signal-lead: must be 1..65535 seconds, got {opts.signal_lead}")
    if opts.time is not None:
        limit = parse_time_limit(opts.time)
        if limit and opts.signal_lead >= limit:
            raise ConfigError(
                f"--signal-lead={opts.signal_lead}s is not shorter than --time={opts.time} "
                f"({limit}s): the job would be signalled to stop as soon as it starts"
            )
    for name in ("partition", "account", "job_name"):
        value = getattr(opts, name)
        if value is not None:
            _sbatch_safe(f"--{name.replace('_', '-')}", value)
    for line in opts.extra:
        if "\n" in line or not line.startswith("-"):
            raise ConfigError(f"--sbatch: {line!r} must be one sbatch option such as --qos=high")


def train_command(
    python: str,
    config: Path | None,
    run_dir: Path,
    ds_config: str,
    overrides: list[str],
    command: str = "train",
) -> list[str]:
    """The command every task runs: `keel COMMAND` (train or preflight) for this run."""
    cmd = [python, "-m", "keel.launcher.cli", command]
    if config is not None:
        cmd.append(str(config))
    cmd += ["--run-dir", str(run_dir), "--ds-config", ds_config]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


PREFLIGHT_STEP = """
# Preflight: measure and judge the allocation first (keel preflight); a bad node stops the job here.
KEEL_PREFLIGHT=({command})
preflight_rc=0
srun --nodes="${{SLURM_JOB_NUM_NODES}}" --ntasks-per-node={tasks_per_node} \\
     ${{SLURM_CPUS_PER_TASK:+--cpus-per-task=${{SLURM_CPUS_PER_TASK}}}} \\
     bash -c 'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID; exec "$@"' \\
     keel-rank "${{KEEL_PREFLIGHT[@]}}" || preflight_rc=$?
if [ "${{preflight_rc}}" -eq {exit_preflight} ]; then
    echo "keel-slurm: preflight found bad node(s) in ${{SLURM_JOB_NODELIST}}: not training; the bad ranks and their" \\
         "hosts are named above and in ${{RUN_DIR}}/preflight.json" >&2
    next_rc=0
    after_ranks "${{preflight_rc}}" || next_rc=$?  # resubmits without the bad nodes, or says too few remain
    exit "${{next_rc}}"
elif [ "${{preflight_rc}}" -ne 0 ]; then
    echo "keel-slurm: preflight failed with exit code ${{preflight_rc}} on ${{SLURM_JOB_NODELIST}}: not training;" \\
         "see the log above" >&2
    exit "${{preflight_rc}}"
fi
echo "keel-slurm: preflight healthy at $(date -Is)"
"""


def preflight_step(opts: SbatchOptions, command: list[str] | None) -> str:
    """The script's first srun step (`keel slurm --preflight`), or nothing."""
    if command is None:
        return ""
    return PREFLIGHT_STEP.format(
        command=" ".join(shlex.quote(part) for part in command),
        tasks_per_node=opts.tasks_per_node,
        exit_preflight=ExitCode.PREFLIGHT,
    )


def render(
    template: str,
    opts: SbatchOptions,
    run_dir: Path,
    workdir: Path,
    command: list[str],
    preflight: list[str] | None = None,
) -> str:
    """The sbatch script; `preflight`: the `keel preflight` command its first srun step runs (None: no step)."""
    optional = []
    if opts.time is not None:
        optional.append(f"--time={opts.time}")
    if opts.gpus_per_node:
        optional.append(f"--gres=gpu:{opts.gpus_per_node}")
    if opts.cpus_per_task is not None:
        optional.append(f"--cpus-per-task={opts.cpus_per_task}")
    if opts.partition:
        optional.append(f"--partition={opts.partition}")
    if opts.account:
        optional.append(f"--account={opts.account}")
    if opts.exclude:
        optional.append(f"--exclude={','.join(opts.exclude)}")
    optional += list(opts.extra)
    fields = {
        "job_name": opts.job_name or f"keel-{run_dir.name}",
        "nodes": opts.nodes,
        "tasks_per_node": opts.tasks_per_node,
        "signal_lead": opts.signal_lead,
        "run_dir": _sbatch_safe("--run-dir", str(run_dir)),
        "run_dir_q": shlex.quote(str(run_dir)),
        "workdir": _sbatch_safe("working directory", str(workdir)),
        "optional_sbatch_lines": "\n".join(f"#SBATCH {line}" for line in optional),
        "train_command": " ".join(shlex.quote(part) for part in command),
        "exit_preempted": ExitCode.PREEMPTED,
        "port_base": PORT_BASE,
        "port_span": PORT_SPAN,
        "preflight_step": preflight_step(opts, preflight),
        "min_nodes": opts.min_nodes or opts.nodes,
        "script_name": SCRIPT_NAME,
    }
    return SbatchTemplate(template).substitute(fields)


def template_path(name: str | None) -> Path:
    from keel.launcher.run_spec import repo_root  # torch: keel --help imports this module

    path = Path(name).expanduser() if name else repo_root() / TEMPLATE
    if not path.is_file():
        raise ConfigError(f"--template: no sbatch template at {path}")
    return path


def prepare_script(args: argparse.Namespace) -> tuple[str, Path]:
    """Check the run for nodes × tasks-per-node ranks, prepare its data, and render the script."""
    from keel.launcher.run_spec import build_run, prepare_data, write_run_dir  # the same

    tasks = args.tasks_per_node if args.tasks_per_node is not None else max(1, args.gpus_per_node)
    opts = SbatchOptions(
        nodes=args.nodes,
        tasks_per_node=tasks,
        gpus_per_node=args.gpus_per_node,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        partition=args.partition,
        account=args.account,
        job_name=args.job_name,
        signal_lead=args.signal_lead,
        extra=tuple(args.sbatch),
        min_nodes=args.min_nodes,
    )
    check_options(opts)
    template = template_path(args.template).read_text()
    config = Path(args.config).expanduser().resolve() if args.config else None
    if config is not None and not config.is_file():
        raise ConfigError(f"config: no such file {args.config}")
    spec = build_run(
        args.config, args.set, args.ds_config, args.run_dir, opts.nodes * opts.tasks_per_node
    )
    _sbatch_safe("--run-dir", str(spec.run_dir))
    if "%" in str(spec.run_dir):
        raise ConfigError(
            f"--run-dir: {spec.run_dir} contains '%', which sbatch expands in the log's file name"
        )
    _sbatch_safe("working directory", str(Path.cwd()))
    prepare_data(spec)
    if not args.dry_run:  # the run as submitted: what a requeue checks its node count against
        write_run_dir(spec)
    opts.exclude = tuple(bad_hosts(spec.run_dir))
    if opts.exclude:
        print(
            f"keel: leaving out node(s) {','.join(opts.exclude)} (recorded in {spec.run_dir}/bad_nodes.json; "
            "delete an entry to give a node back)",
            file=sys.stderr,
        )
    python = args.python or sys.executable
    command = train_command(python, config, spec.run_dir, spec.cfg.train.ds_config, args.set)
    preflight = (
        train_command(python, config, spec.run_dir, spec.cfg.train.ds_config, args.set, "preflight")
        if args.preflight
        else None
    )
    script = render(template, opts, spec.run_dir, Path.cwd(), command, preflight)
    return script, spec.run_dir


def submit(script_path: Path) -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SubmitError(
            "sbatch not found: run on a SLURM submit host, or use --dry-run to only write the script"
        )
    proc = subprocess.run([sbatch, "--parsable", str(script_path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SubmitError(f"sbatch refused {script_path}: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip().split(";")[0]  # "JOBID" or "JOBID;CLUSTER"


def cmd_slurm(args: argparse.Namespace) -> int:
    script, run_dir = prepare_script(args)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SCRIPT_NAME
    path.write_text(script)
    if args.dry_run:
        print(script, end="")
        print(f"keel: wrote {path} (dry run: not submitted)", file=sys.stderr)
        return 0
    try:
        job_id = submit(path)
    except SubmitError as exc:
        print(f"keel: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"keel: submitted job {job_id} | run dir {run_dir} | log {run_dir}/slurm-{job_id}.out",
        flush=True,
    )
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "slurm",
        help="submit a training run to SLURM (requeues itself on preemption)",
        description="Render slurm/keel.sbatch for this run and submit it with sbatch. One SLURM "
        "task per rank; on USR1/TERM the ranks checkpoint and exit 5, and the job "
        "requeues itself and resumes from the run dir.",
    )
    p.add_argument("config", nargs="?", help="run YAML (default: the tiny built-in config)")
    p.add_argument("--ds-config", help="DeepSpeed JSON (default: train.ds_config)")
    p.add_argument(
        "--run-dir",
        help="shared-filesystem directory for checkpoints, metrics and the job log "
        "(default: runs/<config name>); keep it the same to resume",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config field (repeatable)",
    )
    p.add_argument("--nodes", type=int, default=1, help="nodes to allocate (default 1)")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        help="GPUs per node, requested as --gres=gpu:G (default 0: a CPU job, no gres line)",
    )
    p.add_argument(
        "--min-nodes",
        type=int,
        help="when bad nodes are left out of a requeue, run on as few as this many (default: --nodes)",
    )
    p.add_argument(
        "--tasks-per-node",
        type=int,
        help="ranks per node, one SLURM task each (default: --gpus-per-node, or 1 without GPUs)",
    )
    p.add_argument(
        "--cpus-per-task", type=int, help="CPUs per rank (default: the cluster's default)"
    )
    p.add_argument("--time", help="time limit, e.g. 2-00:00:00 (default: the partition's)")
    p.add_argument("--partition", help="SLURM partition")
    p.add_argument("--account", help="SLURM account")
    p.add_argument("--job-name", help="job name (default: keel-<run dir name>)")
    p.add_argument(
        "--signal-lead",
        type=int,
        default=DEFAULT_SIGNAL_LEAD,
        metavar="SECONDS",
        help=f"send USR1 this long before the time limit (default {DEFAULT_SIGNAL_LEAD})",
    )
    p.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="an extra #SBATCH option, e.g. --sbatch=--qos=high (repeatable)",
    )
    p.add_argument("--python", help="python on the compute nodes (default: this one)")
    p.add_argument("--template", help=f"sbatch template (default: Keel's {TEMPLATE})")
    p.add_argument(
        "--preflight",
        action="store_true",
        help="run `keel preflight` as the job's first step; a bad node stops the job before training",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the script and write it to the run dir only"
    )
    return p
