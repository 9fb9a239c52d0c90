"""The layouts a plan chooses from: every combination of the free axes that `keel train` accepts, predicted.

Axes: tp (dividing the heads, within a node), pp (up to the layers), the pipeline schedule (1F1B, interleaved over
2 or 4 chunks, DualPipeV), Ulysses sp, context-parallel cp (where the sequence is long: each of a rank's two
chunks at least MIN_CP_CHUNK tokens), ep (dividing the experts and the data-parallel size), the ZeRO stage,
the micro-batch (dividing the global batch's share per data-parallel rank) and activation checkpointing (none,
every block). An axis the user set (`--set parallel.tp=4`, a `--ds-config`) is pinned. Each candidate passes the
same checks as `keel train` (keel.config.validate, the engine's DeepSpeed check, the pipeline cut) or is
refused with that check's line; refusals are reported by line, with how many layouts each refused.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from keel.config import ConfigError, RunConfig, validate
from keel.engine.ds_config import check_engine_layout
from keel.engine.memory_model import LayerCut, Layout, run_cut
from keel.engine.pipeline_plan import check_pipeline_plan
from keel.tools.plan.devices import Device
from keel.tools.plan.predict import Prediction, predict

# `--set` keys that pin an axis
AXES = {
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.sp": "sp",
    "parallel.cp": "cp",
    "parallel.ep": "ep",
    "parallel.pipeline_schedule": "schedule",
    "parallel.virtual_stages": "schedule",
    "train.micro_batch_size": "micro_batch",
    "train.activation_checkpoint_interval": "checkpointing",
}

# tokens in each of a cp rank's two chunks, at least: below it a ring step's c×c block of attention is too short to
# hide the next K/V's transfer, and the sequence fits a rank without cp (its activations scale with s/cp)
MIN_CP_CHUNK = 1024


@dataclass
class Plans:
    # layouts that fit, fastest first
    ranked: list[Prediction] = field(default_factory=list)
    # valid layouts that do not fit, least over first
    too_big: list[Prediction] = field(default_factory=list)
    # keel train's line → the layouts it refuses
    rejected: dict[str, list[str]] = field(default_factory=dict)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    cfg: RunConfig, ds: dict, gpus: int, gpus_per_node: int, pinned: set[str]
) -> Iterator[tuple[RunConfig, dict, str]]:
    """(config, DeepSpeed JSON, family) for every combination of the free axes."""
    model, parallel, train = cfg.model, cfg.parallel, cfg.train

    def axis(name: str, values: list, current) -> list:
        return [current] if name in pinned else values

    tps = axis(
        "tp",
        [t for t in divisors(model.n_heads) if t <= gpus_per_node and gpus % t == 0],
        parallel.tp,
    )
    pps = axis("pp", [p for p in divisors(gpus) if p <= model.n_layers], parallel.pp)
    sps = axis("sp", [s for s in divisors(model.n_heads) if s <= 8], parallel.sp)
    seq = cfg.data.seq_len
    cps = axis(
        "cp",
        [1]
        + [c for c in divisors(gpus)[1:] if seq % (2 * c) == 0 and seq // (2 * c) >= MIN_CP_CHUNK],
        parallel.cp,
    )
    eps = axis("ep", divisors(model.moe_experts) if model.moe_experts else [1], parallel.ep)
    stage_now = ds.get("zero_optimization", {}).get("stage", 0)
    stages = [stage_now] if "zero" in pinned else [0, 1, 2, 3]
    schedules = axis(
        "schedule",
        [("1f1b", 2), ("interleaved", 2), ("interleaved", 4), ("dualpipev", 2)],
        (parallel.pipeline_schedule, parallel.virtual_stages),
    )
    checkpointing = axis("checkpointing", [0, 1], train.activation_checkpoint_interval)
    for tp, pp, sp, cp, ep, stage in itertools.product(tps, pps, sps, cps, eps, stages):
        if gpus % (tp * pp * cp * sp):
            continue
        dp = gpus // (tp * pp * cp * sp)
        share = train.global_batch_size // dp if train.global_batch_size % dp == 0 else 0
        micro = axis(
            "micro_batch",
            [m for m in divisors(share) if m <= 16] if share else [1],
            train.micro_batch_size,
        )
        for (schedule, chunks), mb, ckpt in itertools.product(
            schedules if pp > 1 else [("1f1b", 2)], micro, checkpointing
        ):
            run = copy.deepcopy(cfg)
            run.parallel = dataclasses.replace(
                run.parallel,
                tp=tp,
                pp=pp,
                sp=sp,
                cp=cp,
                ep=ep,
                pipeline_schedule=schedule,
                virtual_stages=chunks,
            )
            run.train = dataclasses.replace(
                run.train, micro_batch_size=mb, activation_checkpoint_interval=ckpt
            )
            raw = copy.deepcopy(ds)
            raw.setdefault("zero_optimization", {})["stage"] = stage
            context = f" cp{cp}" if cp > 1 else ""
            yield run, raw, f"tp{tp} pp{pp}{context} sp{sp} ep{ep} zero{stage} mb{mb}"


def make_plans(
    cfg: RunConfig,
    ds: dict,
    gpus: int,
    gpus_per_node: int,
    device: Device,
    pinned: set[str],
) -> Plans:
    plans = Plans()
    # what many candidates share, made once: the memory model's layer cut, each check's verdict per input
    cuts: dict[str, LayerCut] = {}
    checked: dict[str, str] = {}

    def once(key: list, check) -> None:
        text = json.dumps(key, sort_keys=True)
        if text not in checked:
            try:
                check()
                checked[text] = ""
            except ConfigError as err:
                checked[text] = str(err)
        if checked[text]:
            raise ConfigError(checked[text])

    for run, raw, family in candidates(cfg, ds, gpus, gpus_per_node, pinned):
        parallel, stage = run.parallel, raw["zero_optimization"]["stage"]
        try:
            validate(run, gpus)
            once(
                [
                    raw,
                    parallel.tp,
                    parallel.pp,
                    parallel.sp,
                    parallel.cp,
                    run.train.micro_batch_size,
                ],
                functools.partial(check_engine_layout, run, raw, gpus),
            )
            once([structure_of(run), stage > 0], functools.partial(check_pipeline_plan, run, stage))
        except ConfigError as err:
            plans.rejected.setdefault(str(err), []).append(family)
            continue
        structure = json.dumps(structure_of(run))
        if structure not in cuts:
            cuts[structure] = run_cut(run, Layout(tp=parallel.tp, pp=parallel.pp, ep=parallel.ep))
        prediction = predict(run, raw, gpus, gpus_per_node, device, cuts[structure])
        prediction.overrides, prediction.ds = overrides_of(run), raw
        (plans.ranked if prediction.fits else plans.too_big).append(prediction)
    plans.ranked.sort(key=lambda p: p.step_s)
    plans.too_big.sort(key=lambda p: p.memory.peak / p.memory_limit)
    return plans


def structure_of(run: RunConfig) -> list:
    """What the pipeline's cut depends on."""
    parallel = run.parallel
    return [
        parallel.tp,
        parallel.ep,
        parallel.pp,
        parallel.pipeline_schedule,
        parallel.virtual_stages,
        parallel.pipeline_partition,
    ]


def overrides_of(run: RunConfig) -> list[str]:
    """The `--set` items that make `keel train` run this layout (its ZeRO stage travels in its JSON)."""
    parallel, train = run.parallel, run.train
    items = [
        f"parallel.tp={parallel.tp}",
        f"parallel.pp={parallel.pp}",
        f"parallel.sp={parallel.sp}",
        f"parallel.cp={parallel.cp}",
        f"parallel.ep={parallel.ep}",
        f"train.micro_batch_size={train.micro_batch_size}",
        f"train.activation_checkpoint_interval={train.activation_checkpoint_interval}",
    ]
    if parallel.pp > 1:
        items += [
            f"parallel.pipeline_schedule={parallel.pipeline_schedule}",
            f"parallel.virtual_stages={parallel.virtual_stages}",
        ]
    return items
