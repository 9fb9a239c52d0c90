"""The DeepSpeed and torch internals Keel relies on (keel/adapters/), probed and used on real one-rank engines.

One spawned process (world size 1) builds an engine per kind — ZeRO 0-3, fp16, bf16, an MoE model, DeepSpeed's
pipeline engine — and on each one: `check_engine` passes; every adapter function returns what its docstring
says at the moment Keel calls it (inside the step gate); a vetoed step leaves parameters, Adam moments and the
LR schedule untouched while an allowed one changes them; and removing each internal the engine needs makes
`check_engine` fail with one line naming it.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keel.adapters import deepspeed_internals as dsi
from keel.adapters.deepspeed_internals import probes
from keel.adapters.torch_internals import INTERNALS as TORCH_INTERNALS
from keel.adapters.torch_internals import check_torch, set_last_lr
from keel.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from keel.launcher.local import free_port
from tests.spawned import start_world

REPO = Path(__file__).resolve().parents[1]
DS_CONFIGS = REPO / "ds_configs"
MODEL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_pad_multiple=1)
KINDS = ["zero0", "zero1", "zero2", "zero3", "fp16", "bf16", "moe", "pipeline", "dualpipev"]
PIPELINES = (
    "pipeline",
    "dualpipev",
)  # DeepSpeed's PipelineEngine, and its DualPipeVEngine (two stages on one rank)


def _batches(n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, MODEL["vocab_size"], (2, 9), generator=g) for _ in range(n)]


def _engine(kind: str):
    from keel.engine.build import build_engine
    from keel.engine.pipeline import build_pipeline
    from keel.parallel.layer_parallel import LayerParallel
    from keel.parallel.topology import Topology

    moe = dict(moe_experts=4, moe_top_k=2) if kind == "moe" else {}
    schedule = "dualpipev" if kind == "dualpipev" else "1f1b"
    cfg = RunConfig(
        model=ModelConfig(**MODEL, **moe),
        parallel=ParallelConfig(pipeline_schedule=schedule),
        train=TrainConfig(
            global_batch_size=4, micro_batch_size=2, lr=1e-2, warmup_steps=0, grad_clip=1.0
        ),
    )
    ds_name = {
        "zero0": "zero0",
        "zero1": "zero1",
        "zero2": "zero2",
        "zero3": "zero3",
        "fp16": "fp16",
        "bf16": "bf16",
        "moe": "zero1",
        "pipeline": "zero1",
        "dualpipev": "zero1",
    }[kind]
    ds = json.loads((DS_CONFIGS / f"{ds_name}.json").read_text())
    if kind == "fp16":  # a scale the first steps cannot overflow, so the gate is asked on both
        ds["fp16"]["initial_scale_power"] = 8
    topology = Topology.from_env()
    torch.manual_seed(0)
    model = None
    if kind in PIPELINES:  # one pipeline rank: DeepSpeed's pipeline engines all the same
        model = build_pipeline(cfg, topology, LayerParallel.from_topology(topology))
    return build_engine(cfg, ds, topology, model=model)


def _run_step(engine, gate, decide) -> None:
    with gate.deciding(decide):
        if hasattr(engine, "train_batch"):
            engine.train_batch(data_iter=iter([(b[:, :-1], b[:, 1:]) for b in _batches()]))
            return
        for i, batch in enumerate(_batches()):
            engine.set_gradient_accumulation_boundary(i == 1)
            engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()


def _snapshot(engine) -> list[torch.Tensor]:
    """Every parameter (gathered under ZeRO-3) and every Adam moment of the torch optimizer DeepSpeed wraps."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        values = [p.detach().float().clone() for p in params]
    optimizer = dsi.inner_optimizer(engine)
    moments = [
        t.detach().clone()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    ]
    return values + moments


def _probe_kind(kind: str) -> dict:
    """Everything the test asserts about one engine kind, as plain values."""
    from keel.training.guards.base import Action, Decision
    from keel.training.step_gate import Agreed, StepGate

    engine = _engine(kind)
    dsi.check_engine(engine)
    gate = StepGate(engine)
    seen: dict = {
        "adamw": {k: engine.basic_optimizer.defaults.get(k) for k in ("foreach", "fused")}
    }
    wrapped_calls = []

    def before_model_step() -> None:  # gradients reduced, not yet consumed by the step
        wrapped_calls.append(1)
        grads = [dsi.local_grad(p) for p in engine.module.parameters()]
        seen["local_grad_norm"] = math.sqrt(
            sum(float(g.float().pow(2).sum()) for g in grads if g is not None)
        )

    dsi.wrap_model_step(engine, before_model_step)

    def decide(action: Action):
        def inner() -> Agreed:
            seen["norm"] = dsi.grad_norm_before_update(engine)
            seen["scale"] = dsi.loss_scale(engine)
            if hasattr(engine, "train_batch"):
                summed = dsi.pipeline_summed_loss(engine)
                seen["pipeline_loss"] = None if summed is None else float(summed)
            return Agreed(Decision(action))

        return inner

    before = _snapshot(engine)
    _run_step(engine, gate, decide(Action.STEP))
    after = _snapshot(engine)
    params = list(engine.module.parameters())
    held = [dsi.master_state(engine, p) for p in params]  # world size 1: every part is local
    seen["master_keys"] = sorted({k for h in held for k in h})
    truth = [
        h.get("param", h.get("fp32")) for h in held
    ]  # the working copy is the master rounded to its dtype
    seen["master_matches"] = all(t is not None for t in truth) and all(
        torch.equal(t.to(p.dtype).float().reshape(-1)[: v.numel()], v.reshape(-1))
        for t, v, p in zip(truth, after, params)
    )
    stepped = {
        "changed": len(after) > len(before)
        and not all(torch.equal(a, b) for a, b in zip(before, after)),
        "applied": engine.was_step_applied(),
        "lr_steps": engine.lr_scheduler.last_epoch,
    }
    _run_step(engine, gate, decide(Action.SKIP))  # now with Adam moments to leave alone
    again = _snapshot(engine)
    vetoed = {
        "unchanged": len(again) == len(after)
        and all(torch.equal(a, b) for a, b in zip(after, again)),
        "applied": engine.was_step_applied(),
        "lr_steps": engine.lr_scheduler.last_epoch,
        "consulted": gate.consulted,
    }
    missing = {}
    for internal in probes.INTERNALS:  # take each needed internal away: check_engine must name it
        if not internal.applies(engine):
            continue
        original = internal.probe
        object.__setattr__(internal, "probe", lambda e: False)
        try:
            dsi.check_engine(engine)
            missing[internal.name] = None
        except dsi.DeepSpeedInternalsError as exc:
            missing[internal.name] = str(exc)
        finally:
            object.__setattr__(internal, "probe", original)
    return {
        "seen": seen,
        "vetoed": vetoed,
        "stepped": stepped,
        "missing": missing,
        "model_step_wrapped": len(wrapped_calls),
        "wraps": probes.wraps_optimizer(engine),
        "seam": _checkpoint_seam(engine),
    }


# Python's audit events for a change to the filesystem (the write-mode `open`s are told apart by their mode)
_CHANGES = {
    "open",
    "os.mkdir",
    "os.rename",
    "os.remove",
    "os.rmdir",
    "os.chmod",
    "os.truncate",
    "os.symlink",
    "os.link",
    "shutil.copyfile",
    "shutil.copytree",
    "shutil.rmtree",
}


def _is_change(event: str, args: tuple) -> bool:
    if event != "open":
        return event in _CHANGES
    mode, flags = args[1], args[2]
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))


def _checkpoint_seam(engine) -> dict:
    """What `save_checkpoint` did to the filesystem, against what reached Keel's seam: every file under the save
    directory, the files routed through the checkpoint engine's `save`, those made by the other changes routed
    (`elsewhere`), and each change Python's audit hook saw made outside both (none may be). Then the same save with
    DeepSpeed's recovery script landing on a full device (/dev/full), through Keel's WrittenFiles."""
    import sys
    import tempfile

    from keel.training.checkpoint.writes import WrittenFiles

    routed, made, escaped = [], [], []
    depth, watching = [0], [False]

    def inside(call):
        depth[0] += 1
        try:
            return call()
        finally:
            depth[0] -= 1

    def route(save, state_dict, path) -> None:
        routed.append(os.path.relpath(path, tmp))
        inside(lambda: save(state_dict, path))

    def elsewhere(change, path) -> None:
        before = {p for p in Path(tmp).rglob("*") if p.is_file()}
        inside(change)
        made.extend(
            os.path.relpath(p, tmp) for p in Path(tmp).rglob("*") if p.is_file() and p not in before
        )

    def audit(event: str, args: tuple) -> None:
        if watching[0] and not depth[0] and _is_change(event, args):
            escaped.append(f"{event} {args[:2]}")

    sys.addaudithook(
        audit
    )  # for the rest of this throwaway process; it only records while `watching`
    with tempfile.TemporaryDirectory() as tmp:
        watching[0] = True
        with dsi.route_checkpoint_writes(engine, route, elsewhere):
            engine.save_checkpoint(tmp, tag="probe", save_latest=False)
        watching[0] = False
        on_disk = sorted(os.path.relpath(p, tmp) for p in Path(tmp).rglob("*") if p.is_file())
    full = {}
    with tempfile.TemporaryDirectory() as tmp:
        if os.path.exists("/dev/full") and "zero_to_fp32.py" in {Path(m).name for m in made}:
            (Path(tmp) / "zero_to_fp32.py").symlink_to("/dev/full")
            written = WrittenFiles(0)
            with written.seam(engine):
                engine.save_checkpoint(tmp, tag="probe", save_latest=False)
            full = {"error": written.result()[0]}
    return {
        "routed": sorted(routed),
        "made": sorted(made),
        "on_disk": on_disk,
        "escaped": escaped,
        "full": full,
        "restored": not {"save", "makedirs"} & set(vars(engine.checkpoint_engine))
        and "_copy_recovery_script" not in vars(engine),
    }


def _worker(_rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    from keel.engine.distributed import init_distributed

    init_distributed()
    torch.save({kind: _probe_kind(kind) for kind in KINDS}, out)
    os._exit(0)  # gloo can abort at interpreter exit


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("adapters") / "probed.pt"
    start_world(_worker, (free_port(), str(out)), 1)
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_internals_are_present_and_do_what_keel_needs(probed, kind):
    got = probed[kind]
    seen = got["seen"]
    if got[
        "wraps"
    ]:  # DeepSpeed's wrappers report the norm before the update; fp32 ZeRO-0 is Keel's own clipper
        assert seen["norm"] is not None and math.isfinite(seen["norm"]) and seen["norm"] > 0, seen
    else:
        assert kind == "zero0" and seen["norm"] is None
    assert (seen["scale"] is not None) == (kind == "fp16")
    if kind == "fp16":
        assert seen["scale"] == 2.0**8
    if kind in PIPELINES:
        assert seen["pipeline_loss"] is not None and math.isfinite(seen["pipeline_loss"])
    assert got["model_step_wrapped"] == 2  # the hook ran inside both steps
    assert seen["adamw"] == {
        "foreach": None,
        "fused": True,
    }  # torch's fused AdamW, not its per-parameter loop
    # this rank's source of truth and its state (fp32 partitions, or the parameter at plain ZeRO-0), as views
    assert seen["master_matches"] and {"exp_avg", "exp_avg_sq"} <= set(seen["master_keys"]), seen[
        "master_keys"
    ]
    assert ("param" in seen["master_keys"]) == (kind == "zero0")
    if kind in (
        "zero1",
        "zero2",
        "zero3",
    ):  # local gradient shards (here the whole): DeepSpeed's own norm
        assert seen["local_grad_norm"] == pytest.approx(seen["norm"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_every_change_a_checkpoint_save_makes_goes_through_keels_seam(probed, kind):
    """Each file through `engine.checkpoint_engine.save` (Keel hashes it, and keeps a failed write on the rank);
    every other change — directories, DeepSpeed's recovery scripts beside the checkpoints — through the seam's
    `elsewhere`; nothing outside. A recovery script that cannot be written fails the save, not the process."""
    seam = probed[kind]["seam"]
    assert seam["on_disk"] and seam["escaped"] == [] and seam["restored"], seam
    assert sorted(seam["routed"] + seam["made"]) == seam["on_disk"], seam
    assert all(name.startswith("probe/") for name in seam["routed"])
    if (
        kind != "zero0"
    ):  # every ZeRO and mixed-precision save copies zero_to_fp32.py beside its checkpoints
        assert "zero_to_fp32.py" in seam["made"], seam
        error = seam["full"]["error"]
        # the file, where the OSError names it; else the scripts DeepSpeed copies there
        assert re.search(r"/zero_to_(fp32|\*)\.py: \[Errno 28\] No space left on device$", error), (
            error
        )


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_vetoed_step_changes_nothing_and_an_allowed_one_updates(probed, kind):
    vetoed, stepped = probed[kind]["vetoed"], probed[kind]["stepped"]
    # params moved, moments created
    assert stepped["applied"] and stepped["changed"] and stepped["lr_steps"] == 1
    assert (
        vetoed["consulted"]
        and not vetoed["applied"]
        and vetoed["unchanged"]
        and vetoed["lr_steps"] == 1
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.fault("DeepSpeed internal missing (version change)", "one line naming the attribute")
def test_a_missing_internal_fails_in_one_line_naming_it(probed, kind):
    missing = probed[kind]["missing"]
    needed = {"engine._take_model_step", "optimizer.overflow"}
    needed |= {"engine.clip_fp32_gradients"} if kind == "zero0" else {"optimizer._global_grad_norm"}
    assert needed <= set(missing)
    if kind in PIPELINES:
        stages = "PipelineModule._layer_specs / _local_start (DualPipeVModule: phase_bounds / phase_funcs)"
        assert {"PipelineEngine.total_loss", stages} <= set(missing)
    for name, message in missing.items():
        assert message is not None, f"check_engine did not notice {name} missing"
        assert "\n" not in message and f"`{name}`" in message and "setup.py" in message


def test_torch_internals_are_present_and_named_when_missing(monkeypatch):
    check_torch()
    sched = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0), lambda step: 0.5
    )
    set_last_lr(sched, [0.25])
    assert sched.get_last_lr() == [0.25]
    name, _, _ = TORCH_INTERNALS[0]
    monkeypatch.setattr("keel.adapters.torch_internals._scheduler_source", lambda: "")
    with pytest.raises(RuntimeError, match=f"no `{name}`") as info:
        check_torch()
    assert "\n" not in str(info.value)
    monkeypatch.undo()
    name, _, _ = TORCH_INTERNALS[-2]
    assert name.endswith("_hash_ranks_to_str")
    monkeypatch.setattr("keel.adapters.torch_internals._names_groups_by_hash", lambda: False)
    with pytest.raises(RuntimeError, match=f"no `{name}`"):
        check_torch()
    monkeypatch.undo()
    name, _, _ = TORCH_INTERNALS[-1]
    assert "flash_attention_for_cpu" in name
    monkeypatch.setattr("keel.adapters.torch_internals._has_lse_attention", lambda: False)
    with pytest.raises(RuntimeError, match=re.escape(f"no `{name}`")):
        check_torch()


def test_muon_is_imported_without_compiling_until_its_kernels_run():
    """DeepSpeed's ZeRO check imports Muon, whose kernels `torch.compile` at import (inductor, ~1 s per rank):
    imported first by Keel, nothing compiles or imports inductor until a kernel is first called, and
    torch.compile is torch's again afterwards."""
    code = """
import sys, torch
from keel.adapters import deepspeed_internals as dsi
dsi.import_muon_compiling_on_first_use()
from deepspeed.runtime.zero.muon import original_muon
assert dsi.MUON in sys.modules and "torch._inductor.compile_fx" not in sys.modules
assert torch.compile.__module__ == "torch"  # put back
kernel = original_muon.zeropower_via_newtonschulz5
assert kernel.__name__ == "zeropower_via_newtonschulz5" and not hasattr(kernel, "_torchdynamo_orig_callable")
print("lazy")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "lazy", done.stderr[-2000:]
