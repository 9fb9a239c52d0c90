"""Hang detection time: seconds from a rank stalling (inside a step, or inside a checkpoint save) to every rank
having exited with the hang code.

`--phase step` (default): starts `keel train --nproc 2` on a small model with `stability.watchdog_timeout=T` and
a fault that puts rank 1 to sleep for 120 s at the start of step `--stall-step`; times, from rank 0's log line for
the step before it, until the launcher returns. `--phase save`: the same run saves a checkpoint after step
`--stall-step` (`checkpoint.interval`) with `stability.watchdog_save_timeout=T`, and rank 1 stalls 120 s inside
that save (`faults.save_stall_*`: rank 0 waits for it in the save's barrier); timed from rank 0's log line for
that step, which comes just before the save. The wait includes the timeout itself, so the figure to read is the
overshoot (detected − T) and the ratio detected / T (the watchdog's promise: stacks dumped and exit 4 soon after
T, long before the 120 s stall would end). The whole command's time (imports, rendezvous, the steps before the
stall, the wait) is printed too: tests/test_agreed_state.py no longer bounds it.
tests/test_stability.py and tests/test_agreed_state.py check the behaviour (exit code, stack dump, anomaly, the
phase named); this prints the time.

    python bench/hang_detection.py [--phase step|save] [--timeout 5] [--stall-step 4] [--repeats 2]
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

STALL_S = 120  # far beyond any timeout measured here: a run that exits before it was ended by the watchdog


def measure(timeout: float, stall_step: int, phase: str = "step") -> tuple[float, float]:
    """(seconds from the stall to the launcher's return, seconds of the whole command)."""
    if phase == "step":
        fault = [
            f"faults.sleep_step={stall_step}",
            "faults.sleep_rank=1",
            f"faults.sleep_s={STALL_S}",
            f"stability.watchdog_timeout={timeout}",
        ]
        # the sleep is at the start of stall_step: its line never comes
        before_stall = stall_step - 1
    else:
        fault = [
            f"checkpoint.interval={stall_step}",
            "faults.save_stall_rank=1",
            f"faults.save_stall_s={STALL_S}",
            f"faults.save_stall_step={stall_step}",
            f"stability.watchdog_save_timeout={timeout}",
        ]
        before_stall = stall_step  # the step's line comes before its save
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-u",
            "-m",
            "keel.launcher.cli",
            "train",
            "--nproc",
            "2",
            "--run-dir",
            tmp,
            "--ds-config",
            str(REPO / "ds_configs" / "zero0.json"),
        ]
        for item in [*MODEL, f"data.corpus={corpus()}", "train.steps=20", *fault]:
            cmd += ["--set", item]
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        stalled_at = None
        for line in proc.stdout:
            if stalled_at is None and f"step {before_stall:6d}/" in line:
                stalled_at = time.perf_counter()
        proc.wait()
        end = time.perf_counter()
        if proc.returncode != ExitCode.HANG or stalled_at is None:
            raise RuntimeError(
                f"expected the hang exit code {ExitCode.HANG} after step {before_stall}, "
                f"got {proc.returncode}"
            )
        return end - stalled_at, end - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--phase",
        choices=("step", "save"),
        default="step",
        help="where rank 1 stalls: at the start of a step, or inside a checkpoint save",
    )
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--stall-step", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    runs = [measure(args.timeout, args.stall_step, args.phase) for _ in range(args.repeats)]
    times, wholes = [r[0] for r in runs], [r[1] for r in runs]
    detected = statistics.median(times)
    print(
        f"{args.phase} stall: hang detected and every rank exited after {detected:.1f} s (median of {len(times)}: "
        f"{', '.join(f'{t:.1f}' for t in times)}); timeout {args.timeout:g} s; overshoot "
        f"{detected - args.timeout:.1f} s; detected / timeout = {detected / args.timeout:.2f}; the stall would "
        f"have lasted {STALL_S} s"
    )
    print(
        f"whole command (start-up, {args.stall_step} steps, the wait): {statistics.median(wholes):.1f} s (median; "
        f"{', '.join(f'{t:.1f}' for t in wholes)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
