"""Hang detection time: seconds from a rank stalling inside a step to every rank having exited with the hang code.

Starts `keel train --nproc 2` on a small model with `stability.watchdog_timeout=T` and a fault that puts rank 1
to sleep for 120 s at the start of step `--stall-step`; times, from rank 0's log line for the step before it, until
the launcher returns. The wait includes the timeout itself, so the figure to read is the overshoot
(detected − T) and the ratio detected / T (the watchdog's promise: stacks dumped and exit 4 soon after T).
tests/test_stability.py checks the behaviour (exit code, stack dump, anomaly); this prints the time.

    python bench/hang_detection.py [--timeout 5] [--stall-step 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.recovery import MODEL, corpus  # noqa: E402
from keel.run_dir import ExitCode  # noqa: E402


def measure(timeout: float, stall_step: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-u", "-m", "keel.launcher.cli", "train", "--nproc", "2", "--run-dir", tmp,
               "--ds-config", str(REPO / "ds_configs" / "zero0.json")]
        for item in [*MODEL, f"data.corpus={corpus()}", "train.steps=20", f"faults.sleep_step={stall_step}",
                     "faults.sleep_rank=1", "faults.sleep_s=120", f"stability.watchdog_timeout={timeout}"]:
            cmd += ["--set", item]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        stalled_at = None
        for line in proc.stdout:
            if stalled_at is None and f"step {stall_step - 1:6d}/" in line:
                stalled_at = time.perf_counter()
        proc.wait()
        if proc.returncode != ExitCode.HANG or stalled_at is None:
            raise RuntimeError(f"expected the hang exit code {ExitCode.HANG} after step {stall_step - 1}, "
                               f"got {proc.returncode}")
        return time.perf_counter() - stalled_at


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--stall-step", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    times = [measure(args.timeout, args.stall_step) for _ in range(args.repeats)]
    detected = statistics.median(times)
    print(f"hang detected and every rank exited after {detected:.1f} s (median of {len(times)}: "
          f"{', '.join(f'{t:.1f}' for t in times)}); timeout {args.timeout:g} s; overshoot "
          f"{detected - args.timeout:.1f} s; detected / timeout = {detected / args.timeout:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
