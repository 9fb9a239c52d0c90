"""Recovery time after a rank dies: seconds from a SIGKILL of one worker to the first step trained after resuming.

Starts `keel train --nproc 2 --max-restarts 2` (Keel's local launcher: torchrun's elastic agent through its
API) on a small model with a checkpoint every `--interval` steps, waits until metrics.jsonl reaches step
`--kill-at`, and SIGKILLs rank 1's worker process. The agent notices the dead worker (it polls every 0.5 s),
stops the surviving rank, restarts both ranks (restart 1: Keel's backoff sleeps 1 s first), and they resume
from the latest complete checkpoint. Every time below is measured from the moment of the kill:

    failure detected   the agent logs the worker failure ("failed (exitcode: -9)")
    old group gone     no worker process of the first attempt is left (the survivor was stopped)
    workers restarted  new worker processes exist (polled with pgrep every 50 ms)
    engine built       rank 0 logs its topology line (backoff, imports, process group, DeepSpeed engine)
    checkpoint loaded  rank 0 logs "resumed from stepN" (the checkpoint is loaded)
    first step         rank 0 finished the first step after the checkpoint (step N+1)

The first step is timed from rank 0's per-step stdout line (`logging.log_interval=1`), which it prints right
after appending that step's record to metrics.jsonl; the record is checked afterwards (the metrics file is
rewound on resume: records past the checkpoint move to metrics.discarded.jsonl). Steps lost = the last step
trained before the failure (the highest step in metrics.discarded.jsonl, or the kill step) − the checkpoint
step; they are trained again, so the run still ends with one record per step.

It also prints a yardstick measured in the same run: how long two fresh Pythons take to import torch and
DeepSpeed side by side, the floor under "engine built" on this machine.

    python bench/recovery.py [--kill-at 12] [--interval 5] [--steps 30] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from keel.training.metrics import read_metrics  # noqa: E402

MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "data.seq_len=64",
         "data.tokenizer_vocab_size=512", "train.global_batch_size=8", "train.micro_batch_size=2",
         "train.warmup_steps=2", "train.lr=0.01", "train.eval_interval=0", "logging.log_interval=1"]
PHASES = ("failure detected", "old group gone", "workers restarted", "engine built", "checkpoint loaded",
          "first step")


def corpus() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "[" + ", ".join(f'"{stdlib / pkg / "*.py"}"' for pkg in ("json", "email", "http")) + "]"


def entry_pids(run_dir: Path) -> set[int]:
    out = subprocess.run(["pgrep", "-f", f"keel.training.entry {run_dir}"], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


def worker_rank(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(item.split(b"=", 1)[1]) for item in environ if item.startswith(b"RANK=")]
    return ranks[0] if ranks else None


class Output(threading.Thread):
    """Reads the launcher's merged stdout/stderr and timestamps every line as it arrives."""

    def __init__(self, proc: subprocess.Popen, log_file):
        super().__init__(daemon=True)
        self.proc, self.log_file = proc, log_file
        self.lines: list[tuple[float, str]] = []
        self.lock = threading.Lock()

    def run(self) -> None:
        for line in self.proc.stdout:
            now = time.monotonic()
            self.log_file.write(line)
            with self.lock:
                self.lines.append((now, line))

    def first(self, pattern: str, after: float) -> tuple[float, re.Match] | None:
        with self.lock:
            lines = list(self.lines)
        for t, line in lines:
            if t >= after and (m := re.search(pattern, line)):
                return t, m
        return None


def watch_pids(run_dir: Path, old: set[int], t_kill: float, out: dict, stop: threading.Event) -> None:
    """Times when the first attempt's worker processes are all gone, and when new ones appear."""
    while not stop.is_set():
        pids = entry_pids(run_dir)
        now = time.monotonic()
        if "old group gone" not in out and not pids & old:
            out["old group gone"] = now - t_kill
        if "workers restarted" not in out and pids - old:
            out["workers restarted"] = now - t_kill
        if len(out) == 2:
            return
        time.sleep(0.05)


def import_time(n: int = 2) -> float:
    """Yardstick: seconds for `n` concurrent fresh Pythons to import torch and DeepSpeed (what a restarted
    worker does before anything else)."""
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", "import torch, deepspeed"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(n)]
    for proc in procs:
        proc.wait()
    return time.monotonic() - start


def run_once(workdir: Path, args, index: int) -> dict:
    run_dir = workdir / f"run{index}"
    sets = [*MODEL, f"train.steps={args.steps}", f"checkpoint.interval={args.interval}", f"data.corpus={corpus()}",
            f"data.cache_dir={args.cache_dir}"]
    cmd = [sys.executable, "-u", "-m", "keel.launcher.cli", "train", "--nproc", "2", "--max-restarts", "2",
           "--run-dir", str(run_dir), "--ds-config", str(REPO / "ds_configs" / args.ds_config)]
    for item in sets:
        cmd += ["--set", item]
    log_path = workdir / f"run{index}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)
        output = Output(proc, log_file)
        output.start()
        try:
            deadline = time.monotonic() + 600
            pids: set[int] = set()
            victim = None
            while True:
                if victim is None:  # find rank 1's process before the kill step, so the kill is not delayed
                    pids = entry_pids(run_dir)
                    ranks = {pid: worker_rank(pid) for pid in pids}
                    victim = next((pid for pid, rank in ranks.items() if rank == 1), None) if len(pids) == 2 \
                        else None
                records = read_metrics(run_dir / "metrics.jsonl")
                if victim is not None and records and records[-1]["step"] >= args.kill_at:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the run never reached step {args.kill_at}; see {log_path}")
                time.sleep(0.02)
            t_kill = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            kill_step = records[-1]["step"]
            times: dict[str, float] = {}
            stop = threading.Event()
            watcher = threading.Thread(target=watch_pids, args=(run_dir, pids, t_kill, times, stop), daemon=True)
            watcher.start()
            code = proc.wait(timeout=900)
            stop.set()
            watcher.join()
            output.join(timeout=10)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if code != 0:
        raise RuntimeError(f"keel train exited {code}; see {log_path}")
    failed = output.first(r"failed \(exitcode", t_kill)
    resumed = output.first(r"resumed from (step\d+): step (\d+)", t_kill)
    if resumed is None:
        raise RuntimeError(f"no 'resumed from' line after the kill; see {log_path}")
    ckpt_step = int(resumed[1].group(2))
    first = output.first(rf"^step\s+{ckpt_step + 1}/", resumed[0])
    if first is None:
        raise RuntimeError(f"no step {ckpt_step + 1} line after the resume; see {log_path}")
    if failed is not None:
        times["failure detected"] = failed[0] - t_kill
    built = output.first(r"\[keel r0\] world=\d+ ", t_kill)
    if built is not None:
        times["engine built"] = built[0] - t_kill
    times["checkpoint loaded"] = resumed[0] - t_kill
    times["first step"] = first[0] - t_kill
    records = read_metrics(run_dir / "metrics.jsonl")
    if [r["step"] for r in records] != list(range(1, args.steps + 1)):
        raise RuntimeError(f"metrics.jsonl does not hold steps 1..{args.steps} once each; see {run_dir}")
    discarded = read_metrics(run_dir / "metrics.discarded.jsonl")
    last_trained = max([kill_step, *(r["step"] for r in discarded)])
    step_time = statistics.median(r["step_time_s"] for r in records)
    return {"times": times, "kill_step": kill_step, "ckpt_step": ckpt_step, "lost": last_trained - ckpt_step,
            "last_trained": last_trained, "step_time": step_time, "log": log_path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=12, help="SIGKILL rank 1 once metrics.jsonl has this step")
    parser.add_argument("--interval", type=int, default=5, help="checkpoint.interval")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--ds-config", default="zero1.json", help="a file in ds_configs/")
    parser.add_argument("--cache-dir", default="~/.cache/keel", help="prepared data (reused across runs)")
    parser.add_argument("--keep", action="store_true", help="keep the run dirs and logs (printed)")
    args = parser.parse_args()
    if not 0 < args.kill_at < args.steps:
        parser.error("--kill-at must lie between 0 and --steps")
    workdir = Path(tempfile.mkdtemp(prefix="keel-recovery-"))
    results = []
    try:
        for i in range(args.repeats):
            result = run_once(workdir, args, i)
            results.append(result)
            t = result["times"]
            print(f"run {i + 1}/{args.repeats}: rank 1 SIGKILLed at step {result['kill_step']} "
                  f"(last step trained {result['last_trained']}); resumed from step {result['ckpt_step']}; "
                  f"steps lost {result['lost']}; median step time {result['step_time'] * 1e3:.0f} ms", flush=True)
            for phase in PHASES:
                value = f"{t[phase]:7.2f} s" if phase in t else "      -  (not seen)"
                print(f"    {phase + ':':20s}{value}", flush=True)
    finally:
        if args.keep:
            print(f"run dirs and logs kept in {workdir}")
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    print(f"yardstick: 2 concurrent fresh `import torch, deepspeed`: {import_time():.2f} s "
          f"(part of 'engine built'; Keel's restart backoff adds 1 s on the first restart)")
    if len(results) > 1:
        print(f"median over {len(results)} runs (seconds after the kill):")
        for phase in PHASES:
            values = [r["times"][phase] for r in results if phase in r["times"]]
            if values:
                print(f"    {phase + ':':20s}{statistics.median(values):7.2f} s")
        print(f"    {'steps lost:':20s}{statistics.median(r['lost'] for r in results):7.1f}")


if __name__ == "__main__":
    main()
