"""Step time with every stability guard on vs off, measured in one run of this script (target ≤ 1.03).

Trains the same small model with `keel train` on 2 local ranks, alternating guards-off and guards-on runs so
machine noise hits both alike, and compares the median step time over the steps after a warmup. "On" means
the defaults a user gets plus the periodic checks at an aggressive cadence (spike and non-finite guards every
step, cross-rank loss and checksum checks every 10 steps, monitoring every 10 steps, the hang watchdog).

    python bench/guards_overhead.py [--steps 60] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from keel.training.metrics import read_metrics  # noqa: E402

MODEL = ["model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "data.seq_len=128",
         "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_interval=0", "checkpoint.interval=0"]
OFF = ["stability.spike=false", "stability.loss_check_interval=0", "stability.checksum_interval=0",
       "stability.watchdog_timeout=0", "stability.straggler_interval=0", "stability.monitor_interval=0",
       "stability.tensorboard=false", "stability.localize_nonfinite=false"]
ON = ["stability.spike=true", "stability.loss_check_interval=10", "stability.checksum_interval=10",
      "stability.watchdog_timeout=600", "stability.straggler_interval=10", "stability.monitor_interval=10",
      "stability.tensorboard=true"]


def run(run_dir: Path, steps: int, guards: list[str]) -> list[float]:
    cmd = [sys.executable, "-m", "keel.launcher.cli", "train", "--nproc", "2", "--run-dir", str(run_dir)]
    for item in [*MODEL, f"train.steps={steps}", "train.warmup_steps=5", *guards]:
        cmd += ["--set", item]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return [r["step_time_s"] for r in read_metrics(run_dir / "metrics.jsonl")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, guards in (("off", OFF), ("on", ON)):
                steps = run(Path(tmp) / f"{name}{repeat}", args.steps, guards)
                times[name] += steps[args.warmup:]
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"median step time over {len(times['off'])} steps each (2 ranks, {args.repeats} alternating runs):")
    print(f"  guards off: {off * 1e3:8.1f} ms")
    print(f"  guards on:  {on * 1e3:8.1f} ms")
    print(f"  on / off:   {on / off:8.3f}   (target <= 1.03)")
    mean_off, mean_on = statistics.fmean(times["off"]), statistics.fmean(times["on"])
    print(f"  mean on / off (includes the every-10-steps checks): {mean_on / mean_off:.3f}")


if __name__ == "__main__":
    main()
