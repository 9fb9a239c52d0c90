"""Pipeline bubble: each stage's measured idle fraction against the analytic (p-1)/(m+p-1).

Why: with p stages and m micro-batches per step, a flushing pipeline schedule (GPipe, or the 1F1B schedule
DeepSpeed runs) leaves every stage idle for (p-1) micro-batch slots out of m+p-1 (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters", §2.2.1). Raising gradient accumulation is how a
user shrinks that bubble, so Keel's pipeline must really behave that way: this bench measures the bubble of
Keel's pipeline (DeepSpeed's engine over Keel's layers) and prints it beside the formula. Nothing is hard-coded;
every number printed is measured in this run.

How. For each p, p real processes (torchrun, gloo, one thread each) build Keel's engine with pp=p, tp=dp=1,
fp32 ZeRO-0, and train random tokens with m micro-batches per step. Every rank wraps the engine's compute
instructions (ForwardPass and BackwardPass, looked up through the engine's `_INSTRUCTION_MAP`, which holds the
class's functions, so patching the bound methods would miss them) and sums their time per step twice: wall time
(perf_counter) and this thread's CPU time (thread_time; torch runs CPU forward and autograd on the calling
thread). A barrier starts each step on all stages at once; the step's pipeline phase ends when the last stage to
compute finishes (stage 0's last backward). For each stage: idle = phase - busy, idle fraction = idle / phase,
the median over the measured steps (a warmup step per m is dropped); the table's mean is over stages. The
optimizer step, the tied-embedding gradient all-reduce and the loss broadcast come after the phase and are not
in the formula: they are excluded, and their share of the step is printed.

Stages are balanced: the same number of blocks each (`type:Block` partition). The embedding sits on the first
stage and the norm, tied head and loss on the last, so the last stage does a little more per micro-batch (its
fwd+bwd column shows how much), and the other stages wait for it: that raises their idle above the formula.

The formula assumes one device per stage. With more stages than CPU cores (p=4 on a 2-core machine) stages
time-share cores, and the table says so: the phase stretches to at least the total work over the cores, wall
busy time includes time a stage sat descheduled inside a forward or backward, and CPU busy time excludes it.
Neither column is then the one-device-per-stage bubble (on 2 cores both come out well above the formula at
large m), and only the trend (idle falling as m grows) can be judged. Other processes on the machine distort
rows the same way, and that is measured: with a core per stage, a compute thread runs for all of its compute
wall time unless something else takes the core, so on-cpu = CPU busy / wall busy stays near 1 on a quiet
machine; rows where it falls below 0.9 get a warning (the load average is printed too).

`python bench/pipeline_bubble.py [--help]` (about 1.5 minutes on 2 idle CPU cores; exits 0). Ranks import Keel from this
checkout (PYTHONPATH), whichever checkout `pip install -e` points at.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]
WORKER = "worker"
ON_CPU_QUIET = 0.9  # below this, with a core per stage, other processes were taking the cores


@dataclass(frozen=True)
class Shape:
    dim: int = 256
    n_layers: int = 8  # a multiple of every p, so stages hold equal numbers of blocks
    vocab: int = 512
    seq_len: int = 128
    micro_batch: int = 4
    steps: int = 3  # measured steps per m
    warmup: int = 1  # dropped steps per m (buffer allocation, first p2p shape exchange)


# -- one rank (run by torchrun) --------------------------------------------------------------------------------
class StageClock:
    """Time this stage spends in forward/backward instructions during one `train_batch`."""

    def __init__(self, engine) -> None:
        from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

        self.reset()
        compute = {kind: self._timed(engine._INSTRUCTION_MAP[kind]) for kind in (ForwardPass, BackwardPass)}
        engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, **compute}  # instance copy; the class is untouched

    def reset(self) -> None:
        self.busy_wall = self.busy_cpu = 0.0
        self.last_end = 0.0  # perf_counter when the latest compute instruction returned
        self.instructions = 0

    def _timed(self, instruction):
        def run(engine, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            instruction(engine, **kwargs)
            self.busy_cpu += time.thread_time() - cpu
            self.last_end = time.perf_counter()
            self.busy_wall += self.last_end - wall
            self.instructions += 1

        return run


def run_rank(p: int, ms: list[int], shape: Shape, out: Path) -> None:
    """Train with m micro-batches per step for each m; rank 0 writes every rank's per-step timings to `out`."""
    import torch
    import torch.distributed as dist

    from keel.config import ModelConfig, RunConfig
    from keel.parallel.topology import Topology
    from keel.training.ds_config import load_ds_config
    from keel.training.engine import build_engine
    from keel.training.entry import exit_now, init_distributed, setup_logging

    torch.set_num_threads(1)
    init_distributed()
    setup_logging(dist.get_rank())
    cfg = RunConfig()
    cfg.model = ModelConfig(vocab_size=shape.vocab, dim=shape.dim, n_layers=shape.n_layers)
    cfg.parallel.pp, cfg.parallel.pipeline_partition = p, "type:Block"
    cfg.train.micro_batch_size, cfg.train.global_batch_size = shape.micro_batch, shape.micro_batch * ms[0]
    engine = build_engine(cfg, load_ds_config(REPO / "ds_configs" / "zero0.json"), Topology.from_env(pp=p))
    clock = StageClock(engine)
    tokens = torch.Generator().manual_seed(0)
    records = []
    for m in ms:
        engine.set_train_batch_size(m * shape.micro_batch)
        for step in range(shape.warmup + shape.steps):
            batches = [torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq_len + 1), generator=tokens)
                       for _ in range(m)]
            clock.reset()
            dist.barrier()
            start = time.perf_counter()
            engine.train_batch(data_iter=iter([(b[:, :-1], b[:, 1:]) for b in batches]))
            if step >= shape.warmup:
                records.append({"m": m, "busy_wall": clock.busy_wall, "busy_cpu": clock.busy_cpu,
                                "compute_end": clock.last_end - start, "step": time.perf_counter() - start,
                                "instructions": clock.instructions})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))
    dist.barrier()
    exit_now(0)


# -- the driver ---------------------------------------------------------------------------------------------------
def launch(p: int, ms: list[int], shape: Shape) -> list[list[dict]]:
    """Run p ranks with torchrun; return per stage (= rank, as tp = dp = 1) the list of per-step records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(p),
               __file__, WORKER, json.dumps({"p": p, "ms": ms, "shape": asdict(shape), "out": str(out)})]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            text = proc.stdout + proc.stderr
            first = text.find("Traceback")  # the failing rank's own error, not torchrun's summary after it
            raise RuntimeError(f"p={p} ranks failed (exit {proc.returncode}):\n"
                               f"{text[first:first + 6000] if first >= 0 else text[-6000:]}")
        return json.loads(out.read_text())


@dataclass(frozen=True)
class Row:
    p: int
    m: int
    idle_wall: list[float]  # per stage: 1 - wall busy / phase
    idle_cpu: list[float]  # per stage: 1 - CPU busy / phase
    slot_ms: list[float]  # per stage: wall fwd+bwd per micro-batch, ms
    phase_ms: float  # pipeline phase per step
    on_cpu: float  # CPU busy / wall busy, all stages and steps: 1.0 when every stage has a core to itself
    tail_share: float  # (step - phase) / step: optimizer, grad sync and loss broadcast, excluded

    @property
    def analytic(self) -> float:
        return (self.p - 1) / (self.m + self.p - 1)

    @property
    def mean_wall(self) -> float:
        return sum(self.idle_wall) / self.p

    @property
    def mean_cpu(self) -> float:
        return sum(self.idle_cpu) / self.p


def summarize(p: int, m: int, stages: list[list[dict]]) -> Row:
    """Per stage, the median over measured steps (a step disturbed by another process does not skew it)."""
    stages = [[r for r in records if r["m"] == m] for records in stages]
    if any(r["instructions"] != 2 * m for records in stages for r in records):
        raise RuntimeError(f"p={p} m={m}: a stage did not run one forward and one backward per micro-batch")
    steps = list(zip(*stages))  # steps[i][s]: stage s in step i
    # a step's phase ends when its last stage to compute finishes (starts are barrier-aligned)
    phases = [max(r["compute_end"] for r in step) for step in steps]

    def per_stage(value) -> list[float]:
        return [median(value(step[s], phase) for step, phase in zip(steps, phases)) for s in range(p)]

    return Row(p, m, per_stage(lambda r, phase: 1 - r["busy_wall"] / phase),
               per_stage(lambda r, phase: 1 - r["busy_cpu"] / phase),
               per_stage(lambda r, phase: 1e3 * r["busy_wall"] / m), 1e3 * median(phases),
               sum(r["busy_cpu"] for step in steps for r in step) / sum(r["busy_wall"] for step in steps for r in step),
               median(1 - phase / max(r["step"] for r in step) for step, phase in zip(steps, phases)))


def measure(p: int, ms: list[int], shape: Shape) -> list[Row]:
    stages = launch(p, ms, shape)
    return [summarize(p, m, stages) for m in ms]


def report(rows: list[Row], cores: int) -> None:
    fmt = " ".join
    print(f"{'p':>2} {'m':>3} {'idle/stage (wall busy)':>24} {'wall':>6} {'cpu':>6} {'(p-1)/(m+p-1)':>14} "
          f"{'wall/an':>8} {'cpu/an':>7} {'on-cpu':>7} {'phase ms':>9} {'tail':>5}  fwd+bwd ms/mb per stage")
    for r in rows:
        print(f"{r.p:>2} {r.m:>3} {fmt(f'{x:.3f}' for x in r.idle_wall):>24} {r.mean_wall:>6.3f} {r.mean_cpu:>6.3f} "
              f"{r.analytic:>14.3f} {r.mean_wall / r.analytic:>8.2f} {r.mean_cpu / r.analytic:>7.2f} {r.on_cpu:>7.2f} "
              f"{r.phase_ms:>9.0f} {r.tail_share:>5.0%}  {fmt(f'{x:.0f}' for x in r.slot_ms)}")
    print("wall / cpu: mean over stages of 1 - busy/phase, busy = time in forward+backward instructions by "
          "perf_counter / by thread CPU time; on-cpu: CPU busy / wall busy; tail: share of the step after the "
          "phase (grad sync, optimizer, loss broadcast), excluded from the phase.")
    disturbed = [f"p={r.p} m={r.m}" for r in rows if r.p <= cores and r.on_cpu < ON_CPU_QUIET]
    if disturbed:
        print(f"WARNING: {', '.join(disturbed)}: on-cpu < {ON_CPU_QUIET} although each stage could have a core, so "
              "other processes took the cores mid-compute; those rows overstate the bubble. Rerun on a quiet machine.")
    crowded = sorted({r.p for r in rows if r.p > cores})
    if crowded:
        print(f"NOTE: p={', '.join(map(str, crowded))} runs more stages than the {cores} CPU cores here: stages "
              "share cores, so the formula's one-device-per-stage assumption fails. The phase is stretched to at "
              "least the total work over the cores, wall busy includes time descheduled inside compute, CPU busy "
              "excludes it; neither is the per-device bubble. Judge those rows by their trend only.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", default="2,4", help="pipeline stages, comma-separated")
    ap.add_argument("--m", default="1,2,4,8", help="micro-batches per step, comma-separated")
    defaults = Shape()
    for name in ("dim", "n_layers", "vocab", "seq_len", "micro_batch", "steps", "warmup"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [WORKER]:  # one rank, started by `launch` (options here would collide with torchrun's)
        job = json.loads(argv[1])
        run_rank(job["p"], job["ms"], Shape(**job["shape"]), Path(job["out"]))
    args = parse_args(argv)
    ps, ms = [int(x) for x in args.p.split(",")], [int(x) for x in args.m.split(",")]
    shape = Shape(**{k: getattr(args, k) for k in Shape.__dataclass_fields__})
    if any(shape.n_layers % p for p in ps):
        raise SystemExit(f"--n-layers {shape.n_layers} must be a multiple of every p in {ps} (balanced stages)")
    cores = len(os.sched_getaffinity(0))
    print(f"pipeline bubble: Keel pp=p (DeepSpeed 1F1B), tp=dp=1, fp32 ZeRO-0, gloo, 1 thread per rank, {cores} "
          f"CPU cores; dim={shape.dim} layers={shape.n_layers} vocab={shape.vocab} micro-batch={shape.micro_batch}"
          f"x{shape.seq_len} tokens; {shape.steps} measured steps per m after {shape.warmup} warmup")
    start, load = time.perf_counter(), os.getloadavg()[0]
    rows = [row for p in ps for row in measure(p, ms, shape)]
    report(rows, cores)
    print(f"1-minute load average before / after: {load:.1f} / {os.getloadavg()[0]:.1f} on {cores} cores (this "
          f"bench itself adds up to max(p) = {max(ps)}); took {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
