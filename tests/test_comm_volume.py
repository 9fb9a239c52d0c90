"""bench/comm_volume.py: one step's collective bytes (TP, expert-parallel and Ulysses all-to-all, the cp ring) lie
within 5% of the analytic volume, both ways; and the ring's analytic bytes equal, exactly, the `ring_shift` entries
real `keel train` runs under `parallel.cp` record in their collective trace."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from keel.config import load_config
from keel.parallel.topology import GridShape
from tests.keel_runs import Run

BENCH = Path(__file__).resolve().parents[1] / "bench"

TRACED_CP2 = dict(parallel__cp=2, logging__collective_trace="true")
# fp32 K/V and no recompute; bf16 K/V (dK/dV still fp32) with every block's forward run again in backward
CP_RUNS = {
    "cp2": Run.of("cp2", 2, **TRACED_CP2),
    "cp2-bf16-recompute": Run.of(
        "cp2-bf16-recompute",
        2,
        "ds_configs/bf16.json",
        train__activation_checkpoint_interval=1,
        **TRACED_CP2,
    ),
}
KEEL_RUNS = list(CP_RUNS.values())


@pytest.fixture
def bench(monkeypatch):
    # Imported by name from a sys.path entry (not from a file spec), so the forkserver ranks can import it too.
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("comm_volume")


@pytest.mark.slow
def test_tp_collective_volume_matches_megatron(bench):
    shape = bench.Shape()
    names = [case.name for case in bench.CASES]
    assert any("sequence parallel on" in n for n in names) and any(
        "sequence parallel off" in n for n in names
    )
    assert any(n.startswith("ep=") for n in names) and any("Ulysses" in n for n in names)
    assert any(n.startswith("cp=2") for n in names) and any(n.startswith("cp=4") for n in names)
    worlds = sorted({case.world for case in bench.CASES})
    assert worlds == [2, 4]
    for world in worlds:  # one launch per world size
        cases = [case for case in bench.CASES if case.world == world]
        for case, result in zip(cases, bench.measure_all(cases, shape)):
            assert result.case is case
            assert result.calls, f"{case.name}: the recorder saw no collective"
            assert 0.95 <= result.ratio <= 1.05, (
                f"{case.name}: measured / analytic = {result.ratio:.4f}"
            )


def test_recorder_patches_only_inside_its_block(bench):
    before = {op.name: getattr(dist, op.name) for op in bench.OPS}
    assert "batch_isend_irecv" in before  # the cp ring's point-to-point
    with bench.CollectiveRecorder():
        assert all(getattr(dist, name) is not fn for name, fn in before.items())
    assert all(getattr(dist, name) is fn for name, fn in before.items())


def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


@pytest.mark.slow
@pytest.mark.parametrize("name", CP_RUNS)
def test_ring_bytes_equal_the_collective_trace(bench, runs, name):
    """Every rank's traced `ring_shift` bytes over the run = steps × `ring_bytes` for the run's own config: K/V
    in the model's dtype, dK/dV in fp32, the forward's shifts twice under activation checkpointing."""
    run_dir = runs.run(CP_RUNS[name])
    cfg = load_config(str(run_dir / "config.yaml"), [])
    ds = json.loads((run_dir / "ds_config.json").read_text())
    half = any(ds.get(key, {}).get("enabled") for key in ("bf16", "fp16"))
    traces = {
        int(path.stem.removeprefix("trace_rank")): [
            json.loads(line) for line in path.read_text().splitlines()
        ]
        for path in (run_dir / "collectives").glob("trace_rank*.jsonl")
    }
    assert sorted(traces) == [0, 1]
    par, train, model = cfg.parallel, cfg.train, cfg.model
    grid = GridShape(len(traces), tp=par.tp, pp=par.pp, ep=par.ep, sp=par.sp, cp=par.cp)
    kv_heads = bench.ring_kv_heads(model.n_heads, model.n_kv_heads, par.tp, par.sp)
    per_step = bench.ring_bytes(
        train.micro_batch_size,
        cfg.data.seq_len,
        kv_heads,
        model.head_dim,
        par.cp,
        model.n_layers,
        kv_bytes=2 if half else 4,
        micro_batches=train.global_batch_size // (train.micro_batch_size * grid.dp),
        recompute=train.activation_checkpoint_interval > 0,
    )
    assert per_step > 0
    for rank, entries in traces.items():
        ring = [e for e in entries if e["op"] == "ring_shift"]
        by_dtype: dict[str, int] = {}
        for e in ring:
            assert e["group"] == "cp", e
            by_dtype[e["dtype"]] = by_dtype.get(e["dtype"], 0) + e["numel"] * _element_size(
                e["dtype"]
            )
        assert sum(by_dtype.values()) == train.steps * per_step, (
            f"rank {rank}: traced ring bytes {by_dtype} over {train.steps} steps, analytic {per_step} per step"
        )
