"""Per-rank host memory of model build, engine start and the first step, against Keel's memory model.

configs/llama_1b.yaml's widths (dim 2048, 32 heads, 8 kv heads, vocab 32000, tied) with n_layers cut to fit
a 24 GiB machine, seq 128, micro-batch 1, global batch = dp, fp32, on CPU with gloo, 2 real processes per case:
tp=2 (ZeRO-0), and ZeRO-1, ZeRO-2, ZeRO-3 at dp=2. Each rank reports

- import: RSS after importing torch, DeepSpeed and Keel and joining the world (the overhead, reported apart),
- build: peak RSS while the model is built (before `deepspeed.initialize`), VmHWM reset just before,
- engine: peak RSS during `deepspeed.initialize` (reported, no target),
- live / rss: after the first optimizer step, the sum of unique live tensor storages (gc over tensors and the
  optimizer state, deduplicated by storage) and RSS minus the import overhead,

next to keel.engine.memory_model's prediction. Targets: build peak ≤ import + the rank's parameter bytes in
the engine's dtype + the largest parameter in fp32; live and rss ≤ 1.1 × the model's total.

    python bench/memory.py [--layers 4] [--cases tp2,zero1,zero2,zero3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MiB = 2**20


@dataclass(frozen=True)
class Case:
    name: str
    ds_config: str
    tp: int


CASES = {
    c.name: c
    for c in (
        Case("tp2", "zero0", 2),
        Case("zero1", "zero1", 1),
        Case("zero2", "zero2", 1),
        Case("zero3", "zero3", 1),
    )
}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs "5"); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _live_storage_bytes(engine) -> int:
    """Unique tensor storages reachable from Python (gc) plus the optimizer's state, deduplicated by storage."""
    import torch

    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            storage = t.untyped_storage()
            if storage.data_ptr():
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())

    gc.collect()
    with warnings.catch_warnings():  # isinstance on deprecated torch.distributed classes warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            add(obj)
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    return sum(seen.values())


def _rank(rank: int, case: Case, layers: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )
    import deepspeed
    import torch
    import torch.distributed as dist

    from keel.config import DataConfig, ModelConfig, RunConfig, TrainConfig, validate
    from keel.engine.build import build_engine, build_model
    from keel.engine.ds_config import load_ds_config, resolve_ds_config
    from keel.engine.memory_model import Layout, estimate
    from keel.parallel.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    dp = 2 // case.tp
    model_cfg = ModelConfig(
        vocab_size=32000,
        dim=2048,
        n_layers=layers,
        n_heads=32,
        n_kv_heads=8,
        ffn_multiple_of=256,
        rope_theta=500000.0,
        tie_embeddings=True,
    )
    train = TrainConfig(
        steps=1,
        global_batch_size=dp,
        micro_batch_size=1,
        lr_schedule="constant",
        warmup_steps=0,
        ds_config=f"ds_configs/{case.ds_config}.json",
    )
    cfg = RunConfig(model=model_cfg, data=DataConfig(seq_len=128), train=train)
    cfg.parallel.tp = case.tp
    validate(cfg, world_size=2)
    topology = Topology.from_env(tp=case.tp)
    ds_raw = load_ds_config(REPO / cfg.train.ds_config)
    ds = resolve_ds_config(ds_raw, cfg, topology.dp_size)
    predicted = estimate(cfg, ds, Layout(tp=case.tp, dp=dp))

    gc.collect()
    imported = _status("VmRSS")
    resettable = _reset_peak()
    model = build_model(cfg, topology, ds)
    build_peak = _status("VmHWM")
    _reset_peak()
    engine = build_engine(cfg, ds_raw, topology, model=model)
    engine_peak = _status("VmHWM")
    tokens = torch.randint(
        0, model_cfg.vocab_size, (1, 129), generator=torch.Generator().manual_seed(rank)
    )
    loss = engine(tokens[:, :-1].to(engine.device), tokens[:, 1:].to(engine.device))
    engine.backward(loss)
    engine.step()
    live = _live_storage_bytes(engine)
    rss = _status("VmRSS")
    share = predicted.share
    report = dict(
        rank=rank,
        imported=imported,
        resettable=resettable,
        build_peak=build_peak,
        engine_peak=engine_peak,
        live=live,
        rss=rss,
        params=predicted.params,
        grads=predicted.grads,
        optimizer=predicted.optimizer,
        buckets=predicted.buckets,
        total=predicted.total,
        largest_fp32=4 * share.largest,
        n_params=share.total,
        real_params=sum(
            p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters()
        ),
    )
    Path(out, f"{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def run_case(case: Case, layers: int) -> list[dict]:
    import torch.multiprocessing as mp

    from keel.launcher.local import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _rank, args=(case, layers, free_port(), out), nprocs=2, start_method="spawn"
        )
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]


def verdicts(r: dict) -> tuple[bool, bool, bool]:
    build_target = r["imported"] + r["params"] + r["largest_fp32"]
    steady = 1.1 * r["total"]
    return r["build_peak"] <= build_target, r["live"] <= steady, r["rss"] - r["imported"] <= steady


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    print(
        f"llama_1b widths, n_layers={args.layers}, seq 128, micro-batch 1, fp32, CPU/gloo, 2 ranks; MiB per rank"
    )
    head = (
        f"{'case':6} {'rank':>4} {'import':>7} {'build':>7} {'target':>7} {'engine':>7} {'live':>7} "
        f"{'rss-imp':>7} {'model':>7} {'(param':>7} {'grad':>6} {'optim':>6} {'bucket)':>7}  verdict"
    )
    print(head)
    failed = False
    for name in args.cases.split(","):
        for r in run_case(CASES[name], args.layers):
            ok = verdicts(r)
            failed |= not all(ok)
            verdict = " ".join(
                f"{what}:{'PASS' if good else 'FAIL'}"
                for what, good in zip(("build", "live", "rss"), ok, strict=True)
            )
            m = {k: r[k] / MiB for k in r if isinstance(r[k], int)}
            print(
                f"{name:6} {r['rank']:>4} {m['imported']:7.0f} {m['build_peak'] - m['imported']:7.0f} "
                f"{(r['params'] + r['largest_fp32']) / MiB:7.0f} {m['engine_peak'] - m['imported']:7.0f} "
                f"{m['live']:7.0f} {m['rss'] - m['imported']:7.0f} {m['total']:7.0f} {m['params']:7.0f} "
                f"{m['grads']:6.0f} {m['optimizer']:6.0f} {m['buckets']:7.0f}  {verdict}"
                + ("" if r["resettable"] else " (VmHWM not resettable)")
            )
            if r["real_params"] != r["n_params"]:
                print(
                    f"  model counts {r['n_params']} parameters, the engine holds {r['real_params']}"
                )
                failed = True
    print("FAIL" if failed else "PASS")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
