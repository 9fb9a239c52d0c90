"""Training monitoring: dashboard sinks, and per-layer statistics checked against hand computations."""

from __future__ import annotations

import importlib.util
import math
import os
import time
from pathlib import Path

import pytest
import torch

from keel.config import ConfigError, ModelConfig, StabilityConfig
from keel.engine.ds_config import load_ds_config
from keel.launcher.local import free_port
from keel.model import Block, CausalLM
from keel.parallel.topology import Topology
from keel.training.observe.monitor import ModelMonitor
from keel.training.observe.sinks import Sinks, check_sinks, dashboard_scalars
from tests.spawned import start_world

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_pad_multiple=1)


# -- sinks ------------------------------------------------------------------------------------------------------
def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series as TensorBoard itself reads it back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_readable_with_expected_tags(tmp_path):
    sinks = Sinks(tmp_path, StabilityConfig(tensorboard=True, wandb=False), enabled=True)
    for step in (1, 2):
        sinks.log(
            step,
            {
                "step": step,
                "loss": 3.5 / step,
                "lr": 1e-3,
                "grad_norm": None,
                "loss_scale": None,
                "tokens_per_s": 1000.0,
                "skipped": step == 2,
                "val_loss": 4.0,
                "consumed_samples": 16 * step,
                "grad_norm/block0": 0.25,
                "act/block1/max_abs": 7.0,
                "params/update_ratio": 1e-3,
                "guards": {"spike": step},
                "note": "text",
                "bad": float("nan"),
            },
        )
    sinks.close()
    got = _scalars(tmp_path)
    assert set(got) == {
        "train/loss",
        "train/lr",
        "train/tokens_per_s",
        "train/skipped",
        "val/loss",
        "train/consumed_samples",
        "grad_norm/block0",
        "act/block1/max_abs",
        "params/update_ratio",
        "guards/spike",
    }
    assert got["train/loss"] == [(1, 3.5), (2, 1.75)]
    assert got["train/skipped"] == [(1, 0.0), (2, 1.0)]
    assert got["guards/spike"] == [(1, 1.0), (2, 2.0)]
    assert got["params/update_ratio"] == [(1, pytest.approx(1e-3)), (2, pytest.approx(1e-3))]


def test_tensorboard_resume_drops_steps_trained_again(tmp_path):
    stability = StabilityConfig(tensorboard=True, wandb=False)
    first = Sinks(tmp_path, stability)
    for step in range(1, 5):
        first.log(step, {"loss": float(step)})
    first.close()
    # a restart is a new process: its event file's name (a timestamp) sorts after the old one's
    time.sleep(1.1)
    resumed = Sinks(tmp_path, stability, resumed_step=2)  # steps 3, 4 are trained again
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    assert _scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_tensorboard_rollback_drops_steps_trained_again(tmp_path):
    sinks = Sinks(tmp_path, StabilityConfig(tensorboard=True, wandb=False))
    for step in range(1, 5):
        sinks.log(step, {"loss": float(step)})
    sinks.rewind(2)
    for step in (3, 4):
        sinks.log(step, {"loss": 10.0 * step})
    sinks.close()
    assert _scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_disabled_rank_writes_nothing(tmp_path):
    sinks = Sinks(tmp_path, StabilityConfig(tensorboard=True), enabled=False)
    sinks.log(1, {"loss": 1.0})
    sinks.close()
    assert not (tmp_path / "tensorboard").exists()


def test_dashboard_scalars_tag_table():
    assert dashboard_scalars(
        {"step": 3, "loss": 1.0, "val_loss": 2.0, "tokens": 5, "inf": math.inf}
    ) == {"train/loss": 1.0, "val/loss": 2.0, "train/tokens": 5.0}


def test_missing_wandb_is_one_clear_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError) as err:
        # every rank checks, not only the writer
        Sinks("unused", StabilityConfig(wandb=True), enabled=False)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("stability.wandb: true but the wandb package is not installed")
    check_sinks(StabilityConfig(wandb=False))


def test_wandb_offline_writes_under_run_dir(tmp_path, monkeypatch):
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed (optional: pip install wandb)")
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stability = StabilityConfig(
        tensorboard=False, wandb=True, wandb_mode="offline", wandb_project="keel-test"
    )
    sinks = Sinks(run_dir, stability, run_config={"train": {"lr": 0.001}})
    sinks.log(1, {"loss": 2.0, "grad_norm/block0": 0.5})
    sinks.close()
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    runs = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((run_dir / "wandb").iterdir())
    Sinks(run_dir, stability).close()  # a restart continues the same run id
    assert (run_dir / "wandb_id.txt").read_text().strip() == run_id


# -- model monitor on a plain CausalLM --------------------------------------------------------------------------
def _layer_of(name: str, n_layers: int) -> str:
    index = int(name.split(".")[1])
    return {0: "embedding", n_layers + 1: "final_norm", n_layers + 2: "head"}.get(
        index, f"block{index - 1}"
    )


def _batches(n: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, TINY["vocab_size"], (3, 9), generator=gen) for _ in range(n)]


def _forward_backward(model: torch.nn.Module, batches: list[torch.Tensor]) -> None:
    for batch in batches:
        (model(batch[:, :-1], batch[:, 1:]) / len(batches)).backward()


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_monitor_matches_hand_computation(tie, optimizer):
    cfg = ModelConfig(**TINY, tie_embeddings=tie)
    model = CausalLM(cfg, seed=1)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    )
    monitor = ModelMonitor(model, Topology.from_env(), interval=2)
    batches = _batches()

    # step 1 is not a monitor step: no hooks, no copies, nothing returned
    monitor.arm(1)
    assert not model._forward_pre_hooks and all(
        not b._forward_hooks for b in model.modules() if isinstance(b, Block)
    )
    _forward_backward(model, batches)
    monitor.before_step(1)
    assert monitor._snapshot is None and monitor._grad_sq is None
    opt.step()
    opt.zero_grad()
    assert monitor.after_step(1) == {}

    # step 2: compare with hooks and norms computed by hand
    outputs: dict[str, list[torch.Tensor]] = {}
    blocks = [m for m in model.layers if isinstance(m, Block)]
    mine = [
        b.register_forward_hook(
            lambda m, a, out: outputs.setdefault(f"block{m.layer_id}", []).append(out.detach())
        )
        for b in blocks
    ]
    monitor.arm(2)
    assert all(len(b._forward_hooks) == 2 for b in blocks)
    _forward_backward(model, batches)
    for handle in mine:
        handle.remove()
    monitor.before_step(2)
    # hooks are gone once the forward passes are done
    assert all(not b._forward_hooks for b in blocks)

    grad_sq: dict[str, float] = {}
    for (
        name,
        p,
        # named_parameters yields the tied weight once, as the embedding's
    ) in model.named_parameters():
        layer = _layer_of(name, cfg.n_layers)
        grad_sq[layer] = grad_sq.get(layer, 0.0) + p.grad.double().pow(2).sum().item()
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    got = monitor.after_step(2)

    layers = [k.removeprefix("grad_norm/") for k in got if k.startswith("grad_norm/")]
    assert layers == ["embedding", "block0", "block1", "final_norm"] + ([] if tie else ["head"])
    for layer in layers:
        assert got[f"grad_norm/{layer}"] == pytest.approx(math.sqrt(grad_sq[layer]), rel=1e-5)
    assert math.sqrt(sum(got[f"grad_norm/{layer}"] ** 2 for layer in layers)) == pytest.approx(
        total, rel=1e-5
    )

    after = list(model.parameters())
    norm = math.sqrt(sum(p.double().pow(2).sum().item() for p in after))
    update = math.sqrt(
        sum((p.double() - b.double()).pow(2).sum().item() for p, b in zip(after, before))
    )
    assert got["params/norm"] == pytest.approx(norm, rel=1e-5)
    assert got["params/update_ratio"] == pytest.approx(update / norm, rel=1e-4)
    assert got["params/update_ratio"] > 0

    for block, outs in outputs.items():
        x = torch.cat([o.flatten() for o in outs]).double()
        assert len(outs) == len(batches)
        assert got[f"act/{block}/mean"] == pytest.approx(x.mean().item(), rel=1e-4, abs=1e-6)
        assert got[f"act/{block}/std"] == pytest.approx(x.std(correction=0).item(), rel=1e-4)
        assert got[f"act/{block}/max_abs"] == pytest.approx(x.abs().max().item(), rel=1e-6)
    assert {k for k in got if k.startswith("act/")} == {
        f"act/block{i}/{s}" for i in range(2) for s in ("mean", "std", "max_abs")
    }


def test_activation_checkpointing_recompute_is_not_counted():
    cfg = ModelConfig(**TINY)
    results = []
    for interval in (0, 1):  # plain, and recomputing every layer in backward
        model = CausalLM(cfg, seed=1, checkpoint_interval=interval)
        monitor = ModelMonitor(model, Topology.from_env(), interval=1)
        monitor.arm(1)
        _forward_backward(model, _batches())
        monitor.before_step(1)
        results.append(monitor.after_step(1))
    assert results[0].keys() == results[1].keys()
    for key in results[0]:
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-5), key


def test_after_step_without_before_step_says_how_to_call():
    monitor = ModelMonitor(CausalLM(ModelConfig(**TINY)), Topology.from_env(), interval=1)
    monitor.arm(1)
    with pytest.raises(RuntimeError, match=r"before_step\(1\)"):
        monitor.after_step(1)
    disabled = ModelMonitor(CausalLM(ModelConfig(**TINY)), Topology.from_env(), interval=0)
    disabled.arm(5)
    disabled.before_step(5)
    assert disabled.after_step(5) == {} and not disabled._hooks


# -- real DeepSpeed: ZeRO keeps gradients in its own buffers --------------------------------------------------------


def _deepspeed_worker(
    _rank: int, port: int, configs: list[tuple[str, str, bool]], out: str
) -> None:
    """One process, world size 1: the same model and batches under several DeepSpeed configs, 2 monitored steps."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    import deepspeed

    from keel.config import RunConfig, TrainConfig
    from keel.engine.build import build_engine

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    topology = Topology.from_env()
    cfg = RunConfig(
        model=ModelConfig(**TINY),
        train=TrainConfig(global_batch_size=6, micro_batch_size=3, lr=1e-2, warmup_steps=0),
    )
    results = {}
    for name, ds_path, attach in configs:
        engine = build_engine(cfg, load_ds_config(ds_path), topology)
        monitor = ModelMonitor(engine, topology, interval=1)
        if attach:
            monitor.attach(engine)
        steps = []
        for step in (1, 2):
            monitor.arm(step)
            batches = _batches()
            for i, batch in enumerate(batches):
                engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
                engine.backward(engine(batch[:, :-1], batch[:, 1:]))
            has_grad = any(p.grad is not None for p in engine.module.parameters())
            if not attach:
                monitor.before_step(step)
            # the parameter copies it keeps until after_step: none where DeepSpeed holds an fp32 master
            copies = (
                sum(t.numel() for t in monitor._snapshot or [] if t is not None)
                if not attach
                else None
            )
            engine.step()
            ds_norm = engine.get_global_grad_norm()
            steps.append(
                {
                    **monitor.after_step(step),
                    "has_grad": has_grad,
                    "copies": copies,
                    "ds_norm": None if ds_norm is None else float(ds_norm),
                }
            )
        results[name] = steps
    torch.save(results, out)


@pytest.mark.slow
def test_zero_stages_give_the_same_layer_statistics(tmp_path):
    """ZeRO-1/3 read their local gradient and fp32 partitions (p.grad is None there) and keep no parameter copy;
    fp16's gradients come out unscaled."""
    ds_configs = Path(__file__).resolve().parents[1] / "ds_configs"
    configs = [
        ("zero0", str(ds_configs / "zero0.json"), False),
        ("zero1", str(ds_configs / "zero1.json"), False),
        ("zero1_attach", str(ds_configs / "zero1.json"), True),
        ("zero3", str(ds_configs / "zero3.json"), False),
        ("fp16", str(ds_configs / "fp16.json"), False),
    ]  # fp16 at ZeRO-0 is refused by Keel (ds_config.py)
    out = tmp_path / "results.pt"
    start_world(_deepspeed_worker, (free_port(), configs, str(out)), 1)
    results = torch.load(out)
    reference = results["zero0"]
    assert all(r["has_grad"] for r in reference)
    n_params = sum(p.numel() for p in CausalLM(ModelConfig(**TINY)).parameters())
    # plain ZeRO-0, one rank: its share is everything
    assert all(r["copies"] == n_params for r in reference)
    assert all(r["copies"] == 0 for name in ("zero1", "zero3", "fp16") for r in results[name])
    for name, rel in [("zero1", 1e-5), ("zero1_attach", 1e-5), ("zero3", 1e-5), ("fp16", 2e-2)]:
        for step, (got, want) in enumerate(zip(results[name], reference), start=1):
            assert not got["has_grad"], f"{name}: expected ZeRO to hold the gradients"
            layers = [k for k in want if k.startswith("grad_norm/")]
            assert len(layers) == 4 and got.keys() == want.keys(), (name, step)
            for key in want:
                if key.startswith(("grad_norm/", "params/", "act/")):
                    assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-6), (
                        name,
                        step,
                        key,
                    )
            rss = math.sqrt(sum(got[k] ** 2 for k in layers))
            assert rss == pytest.approx(got["ds_norm"], rel=max(rel, 1e-5)), (
                name,
                step,
            )  # DeepSpeed's own norm
