"""Expert parallel and Ulysses sequence parallel reproduce the single-process run (real `keel train`, gloo)."""

from __future__ import annotations

import pytest
import torch

from keel.run_dir import read_anomalies
from keel.training.observe.metrics import read_metrics
from tests.keel_runs import Run
from tests.test_train_equivalence import assert_close, assert_grad_norms_close

pytestmark = pytest.mark.slow

# checksums every 5 steps: expert parameters differ across ep ranks, and must not be mistaken for a bit flip
MOE = dict(model__moe_experts=4, stability__expert_interval=5, stability__checksum_interval=5)
# the 8-rank runs also record their collectives for tests/test_collective_trace.py (it changes no numerics)
FOUR_D = dict(
    MOE,
    parallel__tp=2,
    parallel__pp=2,
    parallel__ep=2,
    parallel__sequence_parallel="true",
    logging__collective_trace="true",
)
TP_SP_EP = dict(
    MOE,
    parallel__tp=2,
    parallel__sequence_parallel="true",
    parallel__sp=2,
    parallel__ep=2,
    logging__collective_trace="true",
)
EP2_BIAS = {**MOE, "parallel__ep": 2, "model__moe_bias_update": 0.01}
ROUTING = [
    (1, 0.0, "probability"),
    (1, 1.0, "probability"),
    (2, 0.0, "probability"),
    (2, 1.0, "position"),
]
BALANCING = {
    **MOE,
    "train__steps": 50,
    "model__moe_top_k": 1,
    "model__moe_z_loss": 0.0,
    "stability__expert_interval": 10,
}
STARVED = {
    **MOE,
    "stability__expert_interval": 2,
    "faults__starve_expert": 2,
    "stability__expert_collapse_checks": 3,
}


def _routing(top_k: int, capacity: float, policy: str) -> dict:
    return dict(
        MOE,
        model__moe_top_k=top_k,
        model__moe_capacity_factor=capacity,
        model__moe_drop_policy=policy,
    )


KEEL_RUNS = [
    Run.of("moe-single", 1, **MOE),
    Run.of("dense-single", 1),
    Run.of("sp2", 2, parallel__sp=2),
    Run.of("ep2pp2", 4, "ds_configs/zero1.json", parallel__ep=2, parallel__pp=2, **MOE),
    Run.of(
        "ep2pp2sp2",
        8,
        "ds_configs/zero1.json",
        parallel__ep=2,
        parallel__pp=2,
        parallel__sp=2,
        **MOE,
    ),
    Run.of("tp2sp2ep2", 8, "ds_configs/zero2.json", **TP_SP_EP),
    Run.of("4d", 8, "ds_configs/zero1.json", **FOUR_D),
    Run.of("4d-resumed", 8, "ds_configs/zero1.json", resume_at=5, **FOUR_D),
    Run.of("ep2-zero1-bias", 2, "ds_configs/zero1.json", **EP2_BIAS),
    Run.of("ep2-zero1-bias-resumed", 2, "ds_configs/zero1.json", resume_at=5, **EP2_BIAS),
    Run.of("starved", 1, **STARVED),
    Run.of("aux-on", 1, **BALANCING, model__moe_aux_loss=0.1),
    Run.of("aux-off", 1, **BALANCING, model__moe_aux_loss=0.0),
    Run.of("bias-on", 1, **BALANCING, model__moe_aux_loss=0.0, model__moe_bias_update=0.01),
]
KEEL_RUNS += [
    Run.of(
        f"ep{ep}-k{k}-c{c}", 2, **({"parallel__ep": 2} if ep == 2 else {}), **_routing(k, c, policy)
    )
    for k, c, policy in ROUTING
    for ep in (1, 2)
]
KEEL_RUNS += [
    Run.of(f"ep2dp2-zero{zero}", 4, f"ds_configs/zero{zero}.json", parallel__ep=2, **MOE)
    for zero in (1, 2)
]
KEEL_RUNS += [
    Run.of(
        f"sp2tp2-{sp}",
        4,
        "ds_configs/zero1.json",
        parallel__sp=2,
        parallel__tp=2,
        parallel__sequence_parallel=sp,
    )
    for sp in ("false", "true")
]


def column(run_dir, key):
    return [r[key] for r in read_metrics(run_dir / "metrics.jsonl")]


def health(run_dir) -> list[dict]:
    return [r["moe"] for r in read_metrics(run_dir / "metrics.jsonl") if "moe" in r]


def assert_same_health(a: list[dict], b: list[dict]) -> None:
    """Same tokens per expert in every layer at every check; the float statistics to rounding."""
    assert len(a) == len(b) and a
    for record_a, record_b in zip(a, b):
        assert record_a.keys() == record_b.keys()
        for layer in record_a:
            x, y = record_a[layer], record_b[layer]
            assert x["tokens_per_expert"] == y["tokens_per_expert"], layer
            for key in ("load_entropy", "dropped", "router_entropy"):
                assert x[key] == pytest.approx(y[key], rel=1e-6), (layer, key)


@pytest.mark.parametrize("top_k,capacity,policy", ROUTING)
def test_ep2_matches_ep1(runs, top_k, capacity, policy):
    sets = _routing(top_k, capacity, policy)
    reference = runs.get(f"ep1-k{top_k}-c{capacity}", 2, **sets)
    sharded = runs.get(f"ep2-k{top_k}-c{capacity}", 2, parallel__ep=2, **sets)
    assert_close(column(sharded, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(sharded, "grad_norm"), column(reference, "grad_norm"))
    dropped = [layer["dropped"] for record in health(sharded) for layer in record.values()]
    assert len(dropped) == 4  # 2 MoE blocks × checks at steps 5 and 10
    if capacity:
        assert min(dropped) > 0  # capacity 1.0 on a non-uniform router drops rows ...
        assert dropped == pytest.approx(
            [layer["dropped"] for record in health(reference) for layer in record.values()]
        )  # ... the same ones at any ep
    else:
        assert max(dropped) == 0.0  # dropless never drops


@pytest.mark.parametrize("zero", [1, 2])
def test_ep2_dp2_zero_matches_single_process(runs, zero):
    reference = runs.get("moe-single", 1, **MOE)
    sharded = runs.get(
        f"ep2dp2-zero{zero}", 4, f"ds_configs/zero{zero}.json", parallel__ep=2, **MOE
    )
    assert_close(column(sharded, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(sharded, "grad_norm"), column(reference, "grad_norm"))
    assert_same_health(health(sharded), health(reference))


def test_ep2_pp2_matches_single_process(runs):
    """The aux losses of both stages' MoE layers reach the gradients through the pipeline."""
    reference = runs.get("moe-single", 1, **MOE)
    piped = runs.get("ep2pp2", 4, "ds_configs/zero1.json", parallel__ep=2, parallel__pp=2, **MOE)
    assert_close(column(piped, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(piped, "grad_norm"), column(reference, "grad_norm"))


def test_ep2_inside_pipeline_stages_with_ulysses_matches_single_process(runs):
    """pp2 x sp2 x dp2 with the experts over the two data-parallel ranks (8 ranks): Ulysses sp inside the
    pipeline stages, with ep."""
    reference = runs.get("moe-single", 1, **MOE)
    got = runs.get(
        "ep2pp2sp2",
        8,
        "ds_configs/zero1.json",
        parallel__ep=2,
        parallel__pp=2,
        parallel__sp=2,
        **MOE,
    )
    assert_close(column(got, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(got, "grad_norm"), column(reference, "grad_norm"))


def test_ulysses_sp2_matches_single_process(runs):
    reference = runs.get("dense-single", 1)
    ulysses = runs.get("sp2", 2, parallel__sp=2)
    assert_close(column(ulysses, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(ulysses, "grad_norm"), column(reference, "grad_norm"))


@pytest.mark.parametrize("megatron_sp", ["false", "true"])
def test_ulysses_sp2_tp2_matches_single_process(runs, megatron_sp):
    reference = runs.get("dense-single", 1)
    both = runs.get(
        f"sp2tp2-{megatron_sp}",
        4,
        "ds_configs/zero1.json",
        parallel__sp=2,
        parallel__tp=2,
        parallel__sequence_parallel=megatron_sp,
    )
    assert_close(column(both, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(both, "grad_norm"), column(reference, "grad_norm"))


def test_tp2_sp2_ep2_matches_single_process(runs):
    """8 ranks: tp=2 (Megatron SP) × Ulysses sp=2 × dp=2 with ep=2, ZeRO-2. Each sp rank routes its sequence
    chunk; the balancing statistics span the whole sequence."""
    reference = runs.get("moe-single", 1, **MOE)
    both = runs.get("tp2sp2ep2", 8, "ds_configs/zero2.json", **TP_SP_EP)
    assert_close(column(both, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(both, "grad_norm"), column(reference, "grad_norm"))
    assert_same_health(health(both), health(reference))


def _model_states(run_dir, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's model files (dense and per-expert; the final one unless `tag`), keyed by
    file and name."""
    ckpt = run_dir / "checkpoints"
    tag = tag or (ckpt / "latest").read_text().strip()
    out = {}
    for path in sorted((ckpt / tag).glob("*model_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        for name, value in state.get("module", state).items():
            if torch.is_tensor(value):
                out[f"{path.name}:{name}"] = value
    return out


def test_4d_tp2_pp2_ep2_trains_resumes_and_matches_single_process(runs):
    """8 ranks: tp=2 × pp=2 × dp=2 with the experts split over ep=2 (edp=1)."""
    reference = runs.get("moe-single", 1, **MOE)
    straight = runs.get("4d", 8, "ds_configs/zero1.json", **FOUR_D)
    assert_close(column(straight, "loss"), column(reference, "loss"), 1e-5)
    assert_grad_norms_close(column(straight, "grad_norm"), column(reference, "grad_norm"))
    assert column(straight, "loss")[-1] < column(straight, "loss")[0] - 0.5

    resumed = runs.get("4d-resumed", 8, "ds_configs/zero1.json", resume_at=5, **FOUR_D)
    assert column(resumed, "loss") == column(straight, "loss")
    assert_same_health(health(resumed)[-1:], health(straight)[-1:])
    a, b = _model_states(resumed), _model_states(straight)
    assert a.keys() == b.keys() and any("expert" in key for key in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_ep2_zero1_resume_is_exact(runs):
    """Per-expert checkpoint files, expert optimizer partitions and the balancing bias all come back."""
    straight = runs.get("ep2-zero1-bias", 2, "ds_configs/zero1.json", **EP2_BIAS)
    resumed = runs.get(
        "ep2-zero1-bias-resumed", 2, "ds_configs/zero1.json", resume_at=5, **EP2_BIAS
    )
    assert column(resumed, "loss") == column(straight, "loss")
    a, b = _model_states(resumed), _model_states(straight)
    assert a.keys() == b.keys() and any("expert" in key for key in a)
    restored = _model_states(resumed, tag="step00000005")  # what the second half started from
    biases = [key for key in restored if key.endswith("balance_bias")]
    # the bias had moved when restored
    assert biases and all(restored[key].abs().sum() > 0 for key in biases)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.fault("MoE expert gets no tokens", "expert_collapse anomaly naming layer and expert")
def test_starved_expert_raises_collapse_warning(runs):
    run = runs.get("starved", 1, **STARVED)
    events = [e for e in read_anomalies(run) if e["kind"] == "expert_collapse"]
    assert {(e["layer"], e["expert"]) for e in events} == {(0, 2), (1, 2)}
    assert all(e["step"] == 6 and e["share"] == 0.0 for e in events)  # the third check, at step 6
    assert all(
        layer["tokens_per_expert"][2] == 0 for record in health(run) for layer in record.values()
    )


def test_balancing_keeps_expert_load_more_uniform(runs):
    """Over 50 steps the load-balancing loss, and separately the aux-loss-free bias, keep expert load more
    uniform than no balancing at all."""
    sets = BALANCING
    balanced = runs.get("aux-on", 1, **sets, model__moe_aux_loss=0.1)
    unbalanced = runs.get("aux-off", 1, **sets, model__moe_aux_loss=0.0)

    def mean_load_entropy(run):
        return (
            sum(layer["load_entropy"] for record in health(run) for layer in record.values()) / 10
        )

    on, off = mean_load_entropy(balanced), mean_load_entropy(unbalanced)
    print(f"mean normalized load entropy over 50 steps: aux on {on:.4f}, aux off {off:.4f}")
    assert on > off

    bias = runs.get("bias-on", 1, **sets, model__moe_aux_loss=0.0, model__moe_bias_update=0.01)
    biased = mean_load_entropy(bias)
    print(f"aux-loss-free bias balancing (no aux loss): {biased:.4f}")
    assert biased > off
