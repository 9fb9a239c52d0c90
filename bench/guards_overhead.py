"""What the stability guards cost at scale-shaped widths: step time and peak memory, guards at their defaults vs off.

configs/llama_1b.yaml's widths (dim 2048, 32 heads, 8 kv heads, vocab 32000, tied embeddings) with `n_layers`
cut to fit 24 GiB on 2 ranks, seq 128, micro-batch 1, global batch = dp = 2, fp32, ZeRO-3 (ds_configs/zero3.json),
trained with `keel train` on 2 local ranks. Guards-off and guards-on runs alternate in this one invocation, so
machine noise hits both alike. "On" is what a user gets: the default intervals (spike and non-finite guards every
step; loss-outlier check, monitor and straggler line every 50 steps; checksums every 100; the hang watchdog).

Prints (targets from issue 12):
- the mean time per step over all steps after the warmup, periodic checks included
  (`step_time_s` + `check_time_s` + `eval_time_s`),
  on / off (≤ 1.03; "inconclusive" when the off runs' means spread more than ±3% around their mean);
- each check's own cost: a monitor step's extra step time, and `check_time_s` of the steps that run the periodic
  checks (50: loss outlier + straggler; 100: those + checksums), each against an ordinary step;
- the extra peak memory of a checking step: every rank's RSS is sampled every few ms; the peak inside a checking
  step (monitor + checks) minus the peak inside ordinary steps, over the latter (≤ 2%).

    python bench/guards_overhead.py [--layers 2] [--steps 100] [--repeats 2] [--interval-scale 1]

With `--interval-scale k` the checks run k times more often (and the on/off ratio overstates their share k-fold);
the amortized overhead at the default intervals is then computed from each check's own cost.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from keel.training.observe.metrics import read_metrics  # noqa: E402

WIDTHS = [
    "model.dim=2048",
    "model.n_heads=32",
    "model.n_kv_heads=8",
    "model.ffn_multiple_of=256",
    "model.tie_embeddings=true",
    "data.tokenizer_vocab_size=32000",
    "data.seq_len=128",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.eval_interval=0",
    "checkpoint.interval=0",
    "train.warmup_steps=5",
    "logging.log_interval=1000",
]
OFF = [
    "stability.spike=false",
    "stability.loss_check_interval=0",
    "stability.checksum_interval=0",
    "stability.watchdog_timeout=0",
    "stability.straggler_interval=0",
    "stability.monitor_interval=0",
    "stability.tensorboard=false",
    "stability.localize_nonfinite=false",
]
PERIODIC, CHECKSUM = (
    50,
    100,
)  # the default intervals: loss outlier, monitor, straggler line / checksums


def guards_on(scale: int) -> list[str]:
    """The defaults (keel/config/schema.py StabilityConfig); `scale` > 1 runs the periodic checks that many times
    more often, for machines too slow to train 100 steps per run (their own costs do not depend on it)."""
    if scale == 1:
        return []
    return [
        f"stability.loss_check_interval={PERIODIC // scale}",
        f"stability.monitor_interval={PERIODIC // scale}",
        f"stability.straggler_interval={PERIODIC // scale}",
        f"stability.checksum_interval={CHECKSUM // scale}",
    ]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    """Polls the ranks' RSS and notes when each metrics record (one per step, written after its checks) appears."""

    def __init__(
        self, proc: subprocess.Popen, metrics: Path, ranks: int = 2, period: float = 0.003
    ):
        super().__init__(daemon=True)
        self.proc, self.metrics, self.ranks, self.period = proc, metrics, ranks, period
        self.samples: list[tuple[float, dict[int, float]]] = []
        self.step_done: dict[int, float] = {}

    def run(self) -> None:
        pids: list[int] = []
        lines = 0
        while self.proc.poll() is None:
            now = time.perf_counter()
            # the ranks are up once rank 0 logs a step
            if len(pids) < self.ranks and self.metrics.exists():
                # the rank processes: the descendants holding the most memory
                pids = sorted(_descendants(self.proc.pid), key=lambda p: _rss_mb(p) or 0)[
                    -self.ranks :
                ]
            if self.metrics.exists():
                text = self.metrics.read_text()
                complete = text.count("\n")
                if complete > lines:
                    for record in read_metrics(self.metrics)[lines:complete]:
                        self.step_done[record["step"]] = now
                    lines = complete
            if pids:
                self.samples.append((now, {p: _rss_mb(p) or 0.0 for p in pids}))
            time.sleep(self.period)

    def peak_in(self, steps: list[int]) -> float:
        """Largest single-rank RSS (MB) sampled inside the given steps' windows (previous record → this record)."""
        peak = 0.0
        for step in steps:
            start, end = self.step_done.get(step - 1), self.step_done.get(step)
            if start is None or end is None:
                continue
            for t, rss in self.samples:
                if start < t <= end:
                    peak = max(peak, max(rss.values()))
        return peak


def run(run_dir: Path, args: argparse.Namespace, guards: list[str]) -> tuple[list[dict], Sampler]:
    cmd = [
        sys.executable,
        "-m",
        "keel.launcher.cli",
        "train",
        "--nproc",
        "2",
        "--run-dir",
        str(run_dir),
        "--ds-config",
        str(REPO / "ds_configs" / "zero3.json"),
    ]
    for item in [*WIDTHS, f"model.n_layers={args.layers}", f"train.steps={args.steps}", *guards]:
        cmd += ["--set", item]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    sampler = Sampler(proc, run_dir / "metrics.jsonl")
    sampler.start()
    _, err = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"keel train exited {proc.returncode}:\n{err[-3000:]}")
    return read_metrics(run_dir / "metrics.jsonl"), sampler


def checks_s(record: dict) -> float:
    """The time after a step spent in the periodic checks and evaluation (the trainer records each phase)."""
    return record.get("check_time_s", 0.0) + record.get("eval_time_s", 0.0)


def own_costs(records: list[dict], warmup: int, periodic: int, checksum: int) -> dict[str, float]:
    """Seconds each kind of check adds, against the median ordinary step. Checksums: the seal at the end of the
    step before a checksum step and the verification inside it (both in step_time_s), plus the comparison after
    it (checks_s)."""
    by_step = {r["step"]: r for r in records if r["step"] > warmup}
    ordinary = [
        r for s, r in by_step.items() if s % periodic and (s + 1) % checksum and s % checksum
    ]
    step = statistics.median(r["step_time_s"] for r in ordinary)
    checks = statistics.median(checks_s(r) for r in ordinary)
    monitor = [
        r["step_time_s"] - step for s, r in by_step.items() if s % periodic == 0 and s % checksum
    ]
    periodic_only = [
        checks_s(r) - checks for s, r in by_step.items() if s % periodic == 0 and s % checksum
    ]
    monitor_cost = statistics.fmean(monitor) if monitor else 0.0
    loss_and_straggler = statistics.fmean(periodic_only) if periodic_only else 0.0
    sums = [
        (by_step[s - 1]["step_time_s"] - step)
        + (r["step_time_s"] - step - monitor_cost)
        + (checks_s(r) - checks - loss_and_straggler)
        for s, r in by_step.items()
        if s % checksum == 0 and s - 1 in by_step
    ]
    return {
        "step": step,
        "monitor": monitor_cost if monitor else math.nan,
        "loss+straggler": loss_and_straggler,
        "checksums": statistics.fmean(sums) if sums else math.nan,
    }


def checksum_pass(layers: int) -> tuple[float, float]:
    """(MB, seconds) of one checksum pass over what one of 2 ZeRO-3 ranks holds at these widths — its halves of
    the fp32 master, both Adam moments and the working partition — measured here, free of the runs' noise. The
    at-rest check makes two passes per checksum interval (seal and verify)."""
    import torch

    from keel.config import ModelConfig
    from keel.model import CausalLM
    from keel.training.guards.consistency import Checksummer

    cfg = ModelConfig(
        vocab_size=32000,
        dim=2048,
        n_layers=layers,
        n_heads=32,
        n_kv_heads=8,
        ffn_multiple_of=256,
        tie_embeddings=True,
    )
    n_params = sum(p.numel() for p in CausalLM(cfg).parameters())
    state = [torch.randn(n_params // 2) for _ in range(4)]
    summer = Checksummer()
    summer.sums(state[:1], torch.device("cpu"))  # weights built, pages touched
    start = time.perf_counter()
    summer.sums(state, torch.device("cpu")).tolist()
    return sum(t.numel() * 4 for t in state) / 2**20, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layers",
        type=int,
        default=2,
        help="model.n_layers (the 1B config's widths, fewer layers)",
    )
    parser.add_argument(
        "--steps", type=int, default=100, help="per run; ≥ 100 / interval-scale so every check runs"
    )
    parser.add_argument("--repeats", type=int, default=2, help="off/on pairs, alternating")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the means")
    parser.add_argument(
        "--interval-scale", type=int, default=1, help="run the periodic checks k times as often"
    )
    args = parser.parse_args()
    k = args.interval_scale
    periodic, checksum = PERIODIC // k, CHECKSUM // k
    means: dict[str, list[float]] = {"off": [], "on": []}
    costs: list[dict[str, float]] = []
    extra_peak: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, guards in (("off", OFF), ("on", guards_on(k))):
                records, sampler = run(Path(tmp) / f"{name}{repeat}", args, guards)
                steps = [r for r in records if r["step"] > args.warmup]
                means[name].append(statistics.fmean(r["step_time_s"] + checks_s(r) for r in steps))
                if name == "on":
                    costs.append(own_costs(records, args.warmup, periodic, checksum))
                    checking = [r["step"] for r in steps if r["step"] % periodic == 0]
                    ordinary = [r["step"] for r in steps if r["step"] % periodic]
                    extra_peak.append((sampler.peak_in(checking), sampler.peak_in(ordinary)))
    off, on = statistics.fmean(means["off"]), statistics.fmean(means["on"])
    spread = max(abs(m / off - 1) for m in means["off"] + means["on"])
    ratio = on / off
    verdict = (
        "inconclusive (A/B spread > ±3%)"
        if spread > 0.03
        else ("meets" if ratio <= 1.03 else "misses")
    )
    print(
        f"{args.layers} layer(s) of llama_1b's widths, ZeRO-3 fp32, 2 ranks, seq 128, global batch 2; "
        f"{args.repeats} alternating off/on pair(s) of {args.steps} steps (first {args.warmup} left out); "
        f"periodic checks every {periodic}, checksums every {checksum} steps"
    )
    print(
        f"  mean s/step, checks included: off {off:.3f}  on {on:.3f}  (runs: off "
        f"{', '.join(f'{m:.3f}' for m in means['off'])}; on {', '.join(f'{m:.3f}' for m in means['on'])})"
    )
    print(
        f"  on / off: {ratio:.3f}  target <= 1.03{' (checks ' + str(k) + 'x as often)' if k > 1 else ''}: "
        f"{verdict} (largest run deviation {spread:.1%})"
    )
    for c in costs:
        amortized = (c["monitor"] + c["loss+straggler"]) / PERIODIC + c["checksums"] / CHECKSUM
        print(
            f"  own cost per check (ordinary step {c['step']:.3f} s): monitor {c['monitor']:+.3f} s, loss outlier + "
            f"straggler {c['loss+straggler']:+.3f} s, checksums {c['checksums']:+.3f} s -> at the default "
            f"intervals {amortized:+.4f} s/step = {amortized / c['step']:+.2%}"
        )
    mb, seconds = checksum_pass(args.layers)
    print(
        f"  one checksum pass over a rank's state ({mb:.0f} MB), measured in this process: {seconds:.3f} s "
        f"({mb / 1024 / seconds:.2f} GB/s); the at-rest check makes 2 per check"
    )
    for checking, ordinary in extra_peak:
        extra = checking - ordinary
        print(
            f"  peak RSS of one rank: checking steps {checking:.0f} MB, ordinary steps {ordinary:.0f} MB, extra "
            f"{extra:+.0f} MB = {extra / ordinary:+.2%} (target <= 2%)"
        )


if __name__ == "__main__":
    main()
