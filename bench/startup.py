"""`keel train` start-up, broken down: the default model on 2 local ranks, data already prepared.

Each repeat runs `keel train --run-dir FRESH --set train.steps=2` (a new run dir each time, the data cache kept from
a first, untimed run) and reads rank 0's start-up record from the run's timeline.jsonl
(keel/training/observe/timeline.py):

    launch            `keel train` started → rank 0's process started (config, data check, run dir, agent)
    imports           the rank's interpreter, torch, DeepSpeed and Keel
    run dir           reading the run's config and data record
    rendezvous        torch.distributed's process group
    process groups    Keel's Topology
    data              opening the token files
    reshard           a resume's layout conversion (none here)
    engine            model build, ZeRO setup, `deepspeed.initialize`
    restore           loading a checkpoint (none here)
    other             between the phases
    first step        the first optimizer step (its compile, its first collectives)

and the total from `keel train`'s start to the end of the first step, against the target (≤ 10 s, issue 28). The
median of each phase over the repeats is printed; `--out FILE` also writes the table as markdown.

    python bench/startup.py [--repeats 3] [--out bench/results/startup_cpu_YYYYMMDD.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from keel.run_dir.goodput import read_timeline  # noqa: E402

TARGET_S = 10.0
PHASES = (
    "launch",
    "imports",
    "run dir",
    "rendezvous",
    "process groups",
    "data",
    "reshard",
    "engine",
    "restore",
    "other",
    "first step",
)


def one_start(run_dir: Path, cache: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "keel.launcher.cli", "train", "--run-dir", str(run_dir)]
    cmd += ["--set", "train.steps=2", "--set", f"data.cache_dir={cache}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"keel train failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    [start] = [r for r in read_timeline(run_dir) if r["event"] == "start"]
    phases = {"launch": start["process_started"] - start["launched_at"], **start["phases"]}
    phases["total"] = start["first_step_at"] + start["phases"]["first step"] - start["launched_at"]
    return phases


def cpu_name() -> str:
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        one_start(Path(tmp) / "warm", cache)  # prepares the data (and any JIT-built op): not timed
        runs = [one_start(Path(tmp) / f"run{i}", cache) for i in range(args.repeats)]
    median = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in (*PHASES, "total")}
    lines = [
        f"# keel train start-up, default model, 2 ranks, data cached ({cpu_name()}, {args.repeats} repeats)",
        "",
        "| phase | median s | each run |",
        "|---|---:|---|",
    ]
    for name in (*PHASES, "total"):
        each = ", ".join(f"{r.get(name, 0.0):.2f}" for r in runs)
        lines.append(f"| {name} | {median[name]:.2f} | {each} |")
    verdict = "met" if median["total"] <= TARGET_S else "NOT met"
    lines += [
        "",
        f"start-up to the end of the first step: {median['total']:.2f} s; target ≤ {TARGET_S:g} s: {verdict}",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(
            text + "\nCommand: `python bench/startup.py" + f" --repeats {args.repeats}`\n"
        )


if __name__ == "__main__":
    main()
