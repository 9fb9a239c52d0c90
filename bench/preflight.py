"""Preflight time: how long `keel preflight` takes, its checks alone and the whole command.

Runs `keel preflight [CONFIG] --nproc N` (the local launcher, a fresh run dir each time) `--repeats` times and
prints, per run and as medians, the checks' own time (`elapsed_s` in preflight.json: from the first barrier to the
gathered measurements, what the table's header calls "checks took") and the whole command's wall time (imports,
rendezvous, the checks, the verdict). The target is a preflight short enough to run before every job: the checks
in about a second and the whole command in seconds on 2 CPU ranks. tests/test_preflight.py checks the behaviour
(the verdict, the checks named, every rank's measurements in the report); this prints the time.

    python bench/preflight.py [configs/llama_1b.yaml] [--nproc 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REPORT_FILE = "preflight.json"  # keel.tools.preflight.report.REPORT_FILE


def measure(config: str | None, nproc: int) -> tuple[float, float, bool]:
    """(checks' seconds from preflight.json, whole command's seconds, healthy) for one `keel preflight`."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "keel.launcher.cli",
            "preflight",
            *([config] if config else []),
            "--nproc",
            str(nproc),
            "--run-dir",
            tmp,
        ]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        whole = time.perf_counter() - start
        report_path = Path(tmp) / REPORT_FILE
        if not report_path.exists():
            raise RuntimeError(
                f"keel preflight exited {proc.returncode} without {REPORT_FILE}:\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        report = json.loads(report_path.read_text())
        return report["elapsed_s"], whole, report["healthy"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="run YAML (default: keel's tiny built-in config)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    runs = [measure(args.config, args.nproc) for _ in range(args.repeats)]
    for i, (checks, whole, healthy) in enumerate(runs, start=1):
        print(
            f"run {i}: checks {checks:.2f} s, whole command {whole:.1f} s, {'healthy' if healthy else 'NOT healthy'}"
        )
    checks, whole = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    print(
        f"keel preflight {args.config or '(tiny built-in config)'} --nproc {args.nproc}: checks {checks:.2f} s, "
        f"whole command {whole:.1f} s (medians of {len(runs)}); the checks are {checks / whole:.0%} of it"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
