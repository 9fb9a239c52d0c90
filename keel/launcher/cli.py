"""`keel` command line: `keel train`, `keel preflight`, `keel prepare`, `keel lr-find`, `keel export`, `keel report`,
`keel slurm`.

Every user mistake (config, data, paths) is reported as one line on stderr with exit code 2, before any rank
starts; tracebacks are for bugs.

`keel --help` (and an error in the arguments) must answer at once: the modules a command runs on (torch, DeepSpeed,
the data pipeline, the tools) are imported inside that command, not at the top (each such import says so).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import time
import traceback
from pathlib import Path

from keel.config import ConfigError
from keel.launcher.deepspeed_launcher import (
    hostfile_slots,
    hostfile_without_bad_nodes,
    launch_deepspeed,
)
from keel.launcher.local import free_port, launch_local, launch_module
from keel.launcher.slurm import add_parser as add_slurm_parser
from keel.launcher.slurm import cmd_slurm as submit_slurm
from keel.run_dir import ExitCode, RunDir
from keel.training.observe.timeline import LAUNCHED_AT


def _default_nproc() -> int:
    import torch  # keel --help start-up

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _external_world_size() -> int | None:
    """WORLD_SIZE when an external launcher (torchrun, deepspeed, srun wrapper) already started this rank."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    text = os.environ["WORLD_SIZE"]
    if not re.fullmatch(r"\s*[0-9]+\s*", text) or int(text) < 1:
        raise ConfigError(
            f"WORLD_SIZE={text!r}: expected a positive integer (the number of ranks its launcher "
            "started)"
        )
    return int(text)


def cmd_train(args: argparse.Namespace) -> int:
    from keel.launcher.run_spec import (
        build_run,
        prepare_data,
        write_run_dir,
    )  # torch: keel --help start-up

    external = _external_world_size()
    if external is not None:
        return _train_in_place(args, external)
    if args.launcher == "deepspeed":
        return _train_with_deepspeed_launcher(args)
    nproc = args.nproc or _default_nproc()
    if nproc < 1:
        raise ConfigError(f"--nproc: must be >= 1, got {nproc}")
    spec = build_run(args.config, args.set, args.ds_config, args.run_dir, nproc)
    prepare_data(spec)
    write_run_dir(spec)
    print(
        f"keel: run dir {spec.run_dir} | {nproc} local rank(s) | ds config {spec.cfg.train.ds_config}",
        flush=True,
    )
    return launch_local(spec.run_dir, nproc, max_restarts=args.max_restarts)


def _train_with_deepspeed_launcher(args: argparse.Namespace) -> int:
    """Check the config for the hostfile's world size and prepare the data, then hand over to `deepspeed`."""
    from keel.launcher.run_spec import (
        build_run,
        prepare_data,
        run_dir_path,
        write_run_dir,
    )  # torch: keel --help start-up

    if not args.hostfile:
        raise ConfigError("--launcher deepspeed needs --hostfile (lines of 'hostname slots=N')")
    hostfile, left_out = hostfile_without_bad_nodes(
        args.hostfile, run_dir_path(args.config, args.run_dir)
    )
    if left_out:
        if args.no_ssh:
            print(
                f"keel: error: node(s) {', '.join(left_out)} are recorded in bad_nodes.json: with --no-ssh, "
                "remove them from the hostfile and renumber --node-rank on every node",
                file=sys.stderr,
            )
            return ExitCode.PREFLIGHT
        print(
            f"keel: leaving out node(s) {', '.join(left_out)} (bad_nodes.json): {hostfile}",
            flush=True,
        )
        args.hostfile = str(hostfile)
    try:
        spec = build_run(
            args.config, args.set, args.ds_config, args.run_dir, _hostfile_world_size(args)
        )
    except ConfigError as err:
        if not left_out:
            raise
        print(
            f"keel: error: too few nodes remain without {', '.join(left_out)} (bad_nodes.json): {err}",
            file=sys.stderr,
        )
        return ExitCode.PREFLIGHT
    prepare_data(spec)
    write_run_dir(spec)
    return _launch_deepspeed(args, "train", spec.run_dir)


def _hostfile_world_size(args: argparse.Namespace) -> int:
    if not args.hostfile:
        raise ConfigError("--launcher deepspeed needs --hostfile (lines of 'hostname slots=N')")
    return sum(slots for _, slots in hostfile_slots(args.hostfile))


def _rank_args(args: argparse.Namespace, run_dir) -> list[str]:
    """The command line each rank gets: the same config, overrides and an explicit run dir."""
    keel_args = ([args.config] if args.config else []) + ["--run-dir", str(run_dir)]
    if args.ds_config:
        keel_args += ["--ds-config", args.ds_config]
    for item in args.set:
        keel_args += ["--set", item]
    return keel_args


def _launch_deepspeed(args: argparse.Namespace, command: str, run_dir) -> int:
    return launch_deepspeed(
        _rank_args(args, run_dir),
        args.hostfile,
        args.no_ssh,
        args.node_rank,
        args.master_addr,
        args.master_port,
        command,
    )


def _train_in_place(args: argparse.Namespace, world_size: int) -> int:
    """Started by an external launcher: rank 0 checks and prepares, the others wait for its verdict."""
    import torch.distributed as dist  # torch: keel --help start-up

    from keel.engine.distributed import init_distributed  # torch: keel --help start-up
    from keel.launcher.run_spec import (
        build_run,
        prepare_data,
        write_run_dir,
    )  # torch: keel --help start-up
    from keel.parallel import comm  # torch: keel --help start-up
    from keel.training.entry import run_sequence  # torch: keel --help start-up

    # cheap: every rank checks
    spec = build_run(args.config, args.set, args.ds_config, args.run_dir, world_size)
    init_distributed()
    verdict = None
    if dist.get_rank() == 0:
        try:
            prepare_data(spec)
            write_run_dir(spec)
        except (ConfigError, ValueError) as exc:
            verdict = str(exc)
    verdict = comm.broadcast_object(verdict, comm.world_control())
    if verdict is not None:
        raise ConfigError(verdict)
    return run_sequence([spec.run_dir])


def cmd_preflight(args: argparse.Namespace) -> int:
    """Measure and judge the allocation (keel/tools/preflight/); started like `keel train`, each rank runs in place."""
    from keel.launcher.run_spec import build_run  # torch: keel --help start-up

    external = _external_world_size()
    if external is not None:
        from keel.tools.preflight.run import (
            resolve_vocab_size,
            run_preflight,
        )  # torch: keel --help start-up

        # every rank checks
        spec = build_run(args.config, args.set, args.ds_config, args.run_dir, external)
        resolve_vocab_size(spec)
        return run_preflight(spec)
    if args.launcher == "deepspeed":
        spec = build_run(
            args.config, args.set, args.ds_config, args.run_dir, _hostfile_world_size(args)
        )
        return _launch_deepspeed(args, "preflight", spec.run_dir)
    nproc = args.nproc or _default_nproc()
    if nproc < 1:
        raise ConfigError(f"--nproc: must be >= 1, got {nproc}")
    # refused here, before any rank
    spec = build_run(args.config, args.set, args.ds_config, args.run_dir, nproc)
    print(f"keel: preflight | run dir {spec.run_dir} | {nproc} local rank(s)", flush=True)
    return launch_module(
        "keel.launcher.cli",
        ["preflight", *_rank_args(args, spec.run_dir)],
        nproc,
        preload=["keel.tools.preflight.run"],
        what="preflight",
        where=str(RunDir(spec.run_dir).preflight),
    )


def cmd_plan(args: argparse.Namespace) -> int:
    """The layouts to use for a model on N devices, predicted (keel/tools/plan/): one table, exit 0 when one fits."""
    import json

    from keel.config import clamp_warmup, load_config  # torch: keel --help start-up
    from keel.engine.ds_config import load_ds_config
    from keel.launcher.run_spec import repo_root, resolve_path
    from keel.tools.plan import describe, resolve_vocab, table, write
    from keel.tools.plan.devices import DEVICES, cpu_device, with_preflight
    from keel.tools.plan.search import AXES, make_plans

    if args.gpus < 1:
        raise ConfigError(f"--gpus: must be >= 1, got {args.gpus}")
    bases = [Path(args.config).resolve().parent] if args.config else []

    def planned_config(items: list[str]):
        """The run config as keel train would hold it, its vocabulary resolved without preparing data."""
        cfg = load_config(args.config, items)
        clamp_warmup(cfg.train)
        resolve_vocab(cfg, bases[0] if bases else Path.cwd())
        return cfg

    cfg = planned_config(args.set)
    ds = load_ds_config(resolve_path(args.ds_config or cfg.train.ds_config, *bases, repo_root()))
    pinned = {AXES[item.split("=", 1)[0]] for item in args.set if item.split("=", 1)[0] in AXES}
    if args.ds_config:
        pinned.add("zero")
    per_node = min(args.gpus_per_node, args.gpus)
    device = cpu_device(per_node) if args.device == "cpu" else DEVICES[args.device]
    if args.preflight:
        device = with_preflight(device, json.loads(Path(args.preflight).read_text()))
    plans = make_plans(cfg, ds, args.gpus, per_node, device, pinned)
    print(
        f"keel plan | {args.gpus} × {device.name} ({per_node} per node) | model dim {cfg.model.dim}, "
        f"{cfg.model.n_layers} layers, seq {cfg.data.seq_len}, global batch {cfg.train.global_batch_size} | "
        f"{len(plans.ranked)} plan(s) fit | figures: {device.source}"
    )
    print(table(plans, args.top))
    if not plans.ranked:
        return ExitCode.USAGE
    if args.write:
        items = write(plans.ranked[0], Path(args.write))
        print(f"keel plan: the best plan's settings in {args.write}: {' '.join(items)}")
    if args.check:
        from keel.launcher.plan_check import check_plan  # torch: keel --help start-up

        best = plans.ranked[0]
        report, broken = check_plan(
            planned_config([*args.set, *best.overrides]), best.ds, args.gpus
        )
        print(f"\nkeel plan --check: {describe(best)} in a simulated world of {args.gpus} ranks")
        print(report)
        for line in broken:  # rules drawn for grids: a pure data-parallel world is its own dp group
            print(f"keel plan --check: at scale: {line}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from keel.data import (
        IndexedDataset,
        ensure_prepared,
        resolve_tokenizer_path,
    )  # torch: keel --help start-up

    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers: must be >= 1, got {args.workers}")
    prepared = ensure_prepared(
        args.inputs or ["default"],
        args.cache_dir,
        args.vocab_size,
        text_field=args.text_field,
        tokenizer=resolve_tokenizer_path(args.tokenizer),
        workers=args.workers,
    )
    print(f"tokenizer {prepared.tokenizer_path}")
    for prefix in prepared.sources:
        print(f"tokens {prefix}.bin")
        # the offline full pass; training checks the ids it uses at the sample
        if args.check_all_ids:
            IndexedDataset(prefix, vocab_size=prepared.vocab_size).validate(prepared.vocab_size)
            print(f"  every id lies in [0, {prepared.vocab_size})")
    print(f"({prepared.num_tokens} tokens, {prepared.num_docs} documents)")
    return 0


def cmd_lr_find(args: argparse.Namespace) -> int:
    """LR range test in this process (world size 1) on the run's model, data and DeepSpeed config."""
    from keel.engine.distributed import setup_logging  # torch: keel --help start-up
    from keel.launcher.run_spec import build_run, prepare_data  # torch: keel --help start-up
    from keel.tools.lr_find import (
        SUGGESTION_RULE,
        run_lr_find,
        single_process_overrides,
    )  # torch: keel --help start-up

    external = _external_world_size()
    if external not in (None, 1):
        raise ConfigError(
            f"lr-find runs in one process, but this was started with WORLD_SIZE={external}"
        )
    if args.steps < 2:
        raise ConfigError(f"--steps: the sweep needs at least 2 steps, got {args.steps}")
    if not 0 < args.min_lr < args.max_lr:
        raise ConfigError(
            f"--min-lr/--max-lr: need 0 < min-lr < max-lr, got {args.min_lr} and {args.max_lr}"
        )
    if not 0 <= args.beta < 1:
        raise ConfigError(f"--beta: the smoothing must lie in [0, 1), got {args.beta}")
    # the plot comes after the sweep: say it before any work
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(
            "lr-find plots its curve with matplotlib, which is not installed: "
            "pip install 'keel[plot]' (or pip install matplotlib)"
        )
    out = Path(args.out).expanduser().resolve()
    spec = build_run(
        args.config, args.set + single_process_overrides(), args.ds_config, str(out), 1
    )
    prepare_data(spec)
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(key, value)
    print(
        f"keel: lr-find on one process (tp=pp=1) | {args.steps} steps, lr {args.min_lr:g} → {args.max_lr:g} | "
        f"ds config {spec.cfg.train.ds_config}",
        flush=True,
    )
    setup_logging(0)
    result = run_lr_find(spec, args.min_lr, args.max_lr, args.steps, out, args.beta)
    print(
        f"keel: wrote {out / 'lr_find.csv'} and {out / 'lr_find.png'} ({len(result.lrs)} steps; "
        f"{result.stop_reason})"
    )
    print(f"keel: rule: {SUGGESTION_RULE}")
    lowest, index = result.min_index, result.suggestion_index()
    if lowest is not None:
        print(
            f"keel: minimum smoothed loss {result.smoothed[lowest]:.4f} at lr {result.lrs[lowest]:.6g}"
        )
    if index is None:
        print(
            "keel: no suggestion: the smoothed loss never fell; lower --min-lr or raise --max-lr/--steps"
        )
    else:
        print(f"keel: suggested lr: {result.lrs[index]:.6g}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A run's checkpoint as a Hugging Face model directory (keel/tools/export/hf_export.py)."""
    from keel.tools.export.hf_export import export_hf  # torch: keel --help start-up

    result = export_hf(
        Path(args.run_dir), Path(args.out_dir), args.step, int(args.max_shard_size * 2**20)
    )
    print(
        f"keel: exported step {result.step} to {result.out_dir} ({result.shards} safetensors shard(s), "
        f"{result.total_bytes / 2**20:.1f} MiB, "
        f"{'fp32 master weights' if result.master_weights else 'module weights (not the fp32 masters)'})"
    )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """A run's plots, report.md and series.json (keel/tools/report/), from whatever the run dir holds now."""
    from keel.tools.report import write_report  # keel --help start-up (~4 ms more imports)

    report = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    print(
        f"keel: report in {report.out_dir}: {len(report.drawn)} plot(s) ({', '.join(report.drawn) or 'none'}), "
        f"report.md, series.json"
    )
    for name, reason in report.skipped.items():
        print(f"keel: no {name} plot: {reason}")
    for name, what in report.left_out.items():
        print(f"keel: left out of {name}: {what}")
    return 0


def cmd_slurm(args: argparse.Namespace) -> int:
    """Render slurm/keel.sbatch for this run (checked and data prepared here first) and submit it."""
    return submit_slurm(args)


def add_launcher_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--launcher",
        choices=["local", "deepspeed"],
        default="local",
        help="local: torchrun's agent on this machine; deepspeed: the deepspeed launcher + --hostfile",
    )
    p.add_argument("--hostfile", help="deepspeed launcher: lines of 'hostname slots=N'")
    p.add_argument(
        "--no-ssh", action="store_true", help="deepspeed launcher: run once per node, no ssh"
    )
    p.add_argument(
        "--node-rank", type=int, default=0, help="deepspeed launcher with --no-ssh: this node"
    )
    p.add_argument(
        "--master-addr", help="deepspeed launcher: rendezvous host (default: first host)"
    )
    p.add_argument(
        "--master-port", type=int, default=29500, help="deepspeed launcher: rendezvous port"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keel", description="Distributed LLM pretraining on DeepSpeed."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train", help="train a model (resumes from the run dir's latest checkpoint)"
    )
    train.add_argument("config", nargs="?", help="run YAML (default: the tiny built-in config)")
    train.add_argument("--ds-config", help="DeepSpeed JSON (default: train.ds_config)")
    train.add_argument("--nproc", type=int, help="local ranks (default: GPUs, or 2 on CPU)")
    train.add_argument(
        "--run-dir", help="where checkpoints, metrics and logs go (default: runs/<config name>)"
    )
    add_launcher_args(train)
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all local ranks after a failure, resuming from the latest checkpoint",
    )
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config field, e.g. --set train.steps=100 (repeatable)",
    )
    train.set_defaults(func=cmd_train)

    preflight = sub.add_parser(
        "preflight",
        help="measure and judge the allocation before a run (exit 9 names bad ranks)",
        description="Launched like `keel train`: collectives per group kind, "
        "rank-pair links, a seeded matmul vote, matmul speed, clock skew, the checkpoint "
        "directory and memory against the run's needs. One table on stdout and "
        "RUN_DIR/preflight.json; exit 0 healthy, 9 with the bad ranks named.",
    )
    preflight.add_argument("config", nargs="?", help="run YAML (default: the tiny built-in config)")
    preflight.add_argument("--ds-config", help="DeepSpeed JSON (default: train.ds_config)")
    preflight.add_argument("--nproc", type=int, help="local ranks (default: GPUs, or 2 on CPU)")
    preflight.add_argument(
        "--run-dir",
        help="where preflight.json goes and checkpoints will (default: runs/<config name>)",
    )
    add_launcher_args(preflight)
    preflight.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config field, e.g. --set faults.preflight_slow_rank=1 (repeatable)",
    )
    preflight.set_defaults(func=cmd_preflight)

    plan = sub.add_parser(
        "plan",
        help="the layouts to use on N devices: memory, step time and MFU predicted",
        description="Enumerates the layouts keel train accepts for this model on --gpus devices (tp, pp and "
        "its schedule, sp, ep, ZeRO stage, micro-batch, activation checkpointing; an axis given with --set or "
        "--ds-config is pinned) and prints the fastest that fit, each with its binding limit and step-time terms, "
        "the closest that do not fit, and why the rest were refused. Exit 0 when one fits, 2 when none does.",
    )
    plan.add_argument("config", nargs="?", help="run YAML (default: the tiny built-in config)")
    plan.add_argument("--gpus", type=int, required=True, help="devices in all")
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--device", choices=["h100", "h200", "b200", "a100", "cpu"], default="h100")
    plan.add_argument(
        "--preflight", help="a preflight.json whose measured rates replace the table's"
    )
    plan.add_argument("--ds-config", help="DeepSpeed JSON (pins its ZeRO stage)")
    plan.add_argument("--top", type=int, default=5)
    plan.add_argument("--write", help="write the best plan's --set items here (and OUT.ds.json)")
    plan.add_argument(
        "--check",
        action="store_true",
        help="build the best plan's first, a middle and the last rank in a simulated world of --gpus ranks "
        "(meta device, fake process group): groups, per-step collectives and bytes, memory",
    )
    plan.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override or pin a field",
    )
    plan.set_defaults(func=cmd_plan)

    prep = sub.add_parser(
        "prepare", help="train (or take) a tokenizer and write the token files for a corpus"
    )
    prep.add_argument(
        "inputs",
        nargs="*",
        help="text/JSONL(.gz/.zst)/parquet files, directories, globs or .bin/.idx "
        "token files (default: the Python stdlib source)",
    )
    prep.add_argument(
        "--tokenizer",
        default="train",
        help="train, or a sentencepiece .model / HF tokenizer.json / HF tokenizer directory",
    )
    prep.add_argument("--vocab-size", type=int, default=4096, help="when training the tokenizer")
    prep.add_argument("--text-field", default="text", help="JSONL field holding the text")
    prep.add_argument("--cache-dir", default="~/.cache/keel")
    prep.add_argument(
        "--workers", type=int, help="tokenizer processes (default: every core this process may use)"
    )
    prep.add_argument(
        "--check-all-ids",
        action="store_true",
        help="also read every id of every token file (training checks a sample before launch and "
        "every id it uses at the sample)",
    )
    prep.set_defaults(func=cmd_prepare)

    find = sub.add_parser(
        "lr-find", help="LR range test: sweep the LR exponentially and suggest a peak LR"
    )
    find.add_argument("config", nargs="?", help="run YAML (default: the tiny built-in config)")
    find.add_argument("--ds-config", help="DeepSpeed JSON (default: train.ds_config)")
    find.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config field, e.g. --set train.global_batch_size=32 (repeatable)",
    )
    find.add_argument("--min-lr", type=float, default=1e-6, help="first LR of the sweep")
    find.add_argument("--max-lr", type=float, default=1.0, help="last LR of the sweep")
    find.add_argument("--steps", type=int, default=100, help="optimizer steps in the sweep")
    find.add_argument(
        "--beta",
        type=float,
        default=0.98,
        help="loss smoothing (EMA); lower lags less behind the LR but is noisier",
    )
    find.add_argument("--out", default="runs/lr_find", help="where lr_find.csv and lr_find.png go")
    find.set_defaults(func=cmd_lr_find)

    export = sub.add_parser(
        "export", help="write a run's checkpoint as a Hugging Face model directory"
    )
    export.add_argument("run_dir", help="the run dir of a keel train (its config and checkpoints)")
    export.add_argument("out_dir", help="the HF directory to create (must not exist)")
    export.add_argument(
        "--step", type=int, help="the checkpoint's step (default: the latest complete one)"
    )
    export.add_argument(
        "--max-shard-size",
        type=float,
        default=2048,
        metavar="MIB",
        help="largest safetensors file in MiB (a bigger tensor gets one of its own)",
    )
    export.set_defaults(func=cmd_export)

    report = sub.add_parser(
        "report", help="plot a run (live or finished): PNGs, report.md and series.json"
    )
    report.add_argument("run_dir", help="the run dir of a keel train")
    report.add_argument(
        "--out", help="where the report goes (default: RUN_DIR/report; replaced atomically)"
    )
    report.set_defaults(func=cmd_report)

    add_slurm_parser(sub).set_defaults(func=cmd_slurm)
    return parser


def main(argv: list[str] | None = None) -> None:
    code, in_place = _run(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if in_place:  # skip gloo's teardown, which can abort after a clean run
        os._exit(code)
    sys.exit(code)


def rank_main(argv: list[str]) -> int:
    """A rank that Keel's local launcher forked (keel/launcher/local.py): `keel preflight` in place."""
    return _run(argv)[0]


def _run(argv: list[str] | None) -> tuple[int, bool]:
    """The command's exit code, and whether this process is a rank of a launcher (then it must not tear down)."""
    launched = time.time()
    args = build_parser().parse_args(argv)
    from keel.data import DataError  # torch: keel --help start-up

    in_place = False
    try:
        # a rank of an external launcher (torchrun, deepspeed, srun) or of Keel's own
        in_place = _external_world_size() is not None
        if not in_place:
            # the job's start, for the ranks' start-up timeline (keel/training/observe/timeline.py), set afresh:
            # a value inherited from an earlier command is not this job's; a rank of an external launcher starts
            # its timeline at its own process start
            os.environ[LAUNCHED_AT] = repr(launched)
        code = args.func(args)
    except (ConfigError, DataError) as exc:
        print(f"keel: error: {exc}", file=sys.stderr)
        code = ExitCode.USAGE
    except Exception:
        if not in_place:
            raise
        traceback.print_exc()  # leave at once so the agent sees the failure (not after gloo's slow teardown)
        code = 1
    return code, in_place


if __name__ == "__main__":
    main(sys.argv[1:])
