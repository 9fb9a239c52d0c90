"""`keel plan` (keel/tools/plan/): every plan it prints is one `keel train` accepts, pinned axes stay pinned, a
model that fits nowhere gets no plan and one line saying by how much, and a sequence too long for one rank gets
context parallelism."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keel.config import RunConfig, load_config, validate
from keel.config.schema import ModelConfig, ParallelConfig, TrainConfig
from keel.engine.ds_config import check_engine_layout
from keel.engine.pipeline_plan import check_pipeline_plan
from keel.launcher.plan_check import check_plan
from keel.tools.plan import describe, table
from keel.tools.plan.devices import DEVICES
from keel.tools.plan.search import MIN_CP_CHUNK, candidates, make_plans
from tests.keel_runs import REPO

ZERO1 = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "gradient_clipping": 1.0}


def _config(heads: int, kv: int, layers: int, width: int, batch: int, experts: int) -> RunConfig:
    cfg = load_config(None, [])
    cfg.model = ModelConfig(
        vocab_size=1024,
        dim=heads * width,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        moe_experts=experts,
        compile="false",
    )
    cfg.train = TrainConfig(**{**cfg.train.__dict__, "global_batch_size": batch, "warmup_steps": 1})
    cfg.parallel = ParallelConfig()
    cfg.data.seq_len = 256
    return cfg


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    heads=st.sampled_from([4, 8, 16]),
    kv_divisor=st.sampled_from([1, 2, 4]),
    layers=st.integers(2, 8),
    width=st.sampled_from([32, 64]),
    batch=st.sampled_from([8, 16, 48]),
    gpus=st.sampled_from([1, 2, 4, 6, 8]),
    experts=st.sampled_from([0, 0, 4]),
)
def test_every_plan_is_a_layout_keel_train_accepts(
    heads, kv_divisor, layers, width, batch, gpus, experts
):
    cfg = _config(heads, max(1, heads // kv_divisor), layers, width, batch, experts)
    plans = make_plans(cfg, ZERO1, gpus, 8, DEVICES["h100"], set())
    cut_checked = set()
    for plan in plans.ranked + plans.too_big:
        # the plan's own settings, applied to the config as `keel train --set` would
        run = load_config(None, [f"{k}={v}" for k, v in _model_sets(cfg)] + plan.overrides)
        run.data.seq_len, run.train.global_batch_size, run.train.warmup_steps = 256, batch, 1
        validate(run, gpus)
        check_engine_layout(run, plan.ds, gpus)
        cut = (tuple(plan.overrides), plan.ds["zero_optimization"]["stage"] > 0)
        if cut not in cut_checked:  # the pipeline's cut builds the model on meta: once per layout
            check_pipeline_plan(run, plan.ds["zero_optimization"]["stage"])
            cut_checked.add(cut)
        parallel = run.parallel
        assert parallel.tp * parallel.pp * parallel.cp * parallel.sp * plan.layout["dp"] == gpus


def _model_sets(cfg: RunConfig) -> list[tuple[str, object]]:
    m = cfg.model
    return [
        ("model.vocab_size", m.vocab_size),
        ("model.dim", m.dim),
        ("model.n_layers", m.n_layers),
        ("model.n_heads", m.n_heads),
        ("model.n_kv_heads", m.n_kv_heads),
        ("model.moe_experts", m.moe_experts),
        ("model.compile", "false"),
    ]


def test_a_pinned_axis_stays_and_the_rest_are_searched():
    cfg = _config(8, 4, 8, 64, 32, 0)
    cfg.parallel.tp = 2
    plans = make_plans(cfg, ZERO1, 8, 8, DEVICES["h100"], {"tp"})
    assert plans.ranked and {p.layout["tp"] for p in plans.ranked + plans.too_big} == {2}
    assert len({(p.layout["pp"], p.layout["zero"]) for p in plans.ranked}) > 1


def test_a_model_that_fits_nowhere_gets_no_plan_and_says_by_how_much():
    cfg = _config(16, 16, 48, 512, 16, 0)  # dim 8192, 48 layers: about 39B parameters
    plans = make_plans(cfg, ZERO1, 1, 1, DEVICES["a100"], set())
    assert not plans.ranked and plans.too_big
    text = table(plans, 5)
    assert text.startswith("no layout fits")
    assert "GiB over the" in text.splitlines()[1]


def test_cp_is_searched_only_where_each_chunk_is_long():
    cfg = _config(8, 4, 4, 32, 64, 0)
    for seq_len, cps in [(256, {1}), (4 * MIN_CP_CHUNK, {1, 2}), (16 * MIN_CP_CHUNK, {1, 2, 4, 8})]:
        cfg.data.seq_len = seq_len
        found = {run.parallel.cp for run, _, _ in candidates(cfg, ZERO1, 8, 8, {"pp", "tp", "sp"})}
        assert found == cps, (seq_len, found)


def _llama_8b(seq_len: int, document_mask: bool) -> RunConfig:
    cfg = load_config(None, [])
    cfg.model = ModelConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        compile="false",
    )
    cfg.train = TrainConfig(**{**cfg.train.__dict__, "global_batch_size": 64, "warmup_steps": 1})
    cfg.parallel = ParallelConfig()
    cfg.data.seq_len, cfg.data.document_mask = seq_len, document_mask
    return cfg


@pytest.mark.parametrize(
    "seq_len, document_mask",
    # packed documents masked: SDPA's [s, s] mask per block at cp = 1 (and keel train refuses pp, sp)
    [(131072, True), (262144, False)],
    ids=["128k documents", "256k"],
)
def test_a_sequence_too_long_for_a_rank_gets_context_parallel(seq_len, document_mask):
    """An 8B Llama on 64 × 80 GB, one pipeline stage and no Ulysses: no layout without cp fits (even tp=8 with
    every block checkpointed), the plans that fit all split the sequence, and the best is one keel train runs."""
    cfg = _llama_8b(seq_len, document_mask)
    plans = make_plans(cfg, ZERO1, 64, 8, DEVICES["h100"], {"pp", "sp"})
    assert plans.ranked and all(p.layout["cp"] > 1 for p in plans.ranked)
    tried = [p for p in plans.too_big if p.layout["cp"] == 1]
    assert any(p.layout["tp"] == 8 and p.layout["checkpointing"] for p in tried)
    best = plans.ranked[0]
    assert (
        f" cp{best.layout['cp']} " in f" {describe(best)} "
        and f"parallel.cp={best.layout['cp']}" in best.overrides
    )
    run = load_config(None, [f"{k}={v}" for k, v in _model_sets(cfg)] + best.overrides)
    run.data.seq_len, run.data.document_mask = seq_len, document_mask
    run.train.global_batch_size, run.train.warmup_steps = 64, 1
    validate(run, 64)
    check_engine_layout(run, best.ds, 64)
    # each rank's share of the sequence is what made it fit: the same layout without cp does not
    assert best.memory.activations * best.layout["cp"] > best.memory_limit


def test_the_check_builds_the_first_a_middle_and_the_last_rank_of_the_plans_world():
    cfg = _config(8, 4, 4, 32, 64, 0)
    cfg.parallel.tp, cfg.parallel.pp = 2, 2
    report, broken = check_plan(cfg, ZERO1, 64)
    rows = [line.split() for line in report.splitlines() if line.startswith("64 tp2")]
    assert [row[2] for row in rows] == ["0", "32", "63"], report
    # each rank made its Topology's groups and knows what one step sends on the device
    assert all(int(row[3]) > 0 and int(row[8]) > 0 for row in rows), report
    assert not broken, broken


@pytest.mark.slow
def test_keel_plan_prints_ranked_plans_and_writes_settings_keel_train_takes(tmp_path):
    out = tmp_path / "plan.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "keel.launcher.cli", "plan", "configs/llama_1b.yaml", "--gpus", "16"]
        + ["--device", "h100", "--top", "3", "--write", str(out), "--check"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("keel plan | 16 × H100") and lines[1].lstrip().startswith("#")
    assert lines[2].lstrip().startswith("1 ") and "MFU" in lines[1]
    items = out.read_text().split()
    assert items[0] == "--set" and any(i.startswith("train.ds_config=") for i in items)
    # --check: the best plan's ranks 0, 8 and 15 built in a simulated world of 16
    check = proc.stdout[proc.stdout.index("keel plan --check:") :].splitlines()
    assert "simulated world of 16 ranks" in check[0]
    assert [line.split()[2] for line in check if line.startswith("16 ") and " r" not in line] == [
        "0",
        "8",
        "15",
    ], proc.stdout[-3000:]
