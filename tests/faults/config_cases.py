"""Run configs for the config fuzzer, drawn from the schema (field types, CHOICES) and keel/config/bounds.py.

A `Case` is what a user hands `keel train`: a YAML file, `--set` strings, a DeepSpeed JSON and a world size.
`valid_cases` draws configs that every rule admits, with the value each field must read back as; the rules that
relate fields (heads divide the width, the batch splits over the ranks, ZeRO stage vs pipeline) are stated again
in `layouts`, independently of keel/config/rules.py, so a validator stricter than its rules fails here.
`invalid_cases` breaks one thing in a valid case and names the field the one-line error must name.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml
from hypothesis import strategies as st

from keel.config import RunConfig
from keel.config.bounds import BOUNDS, INT64_MAX, Bound
from keel.config.rules import COMPILE_SETTINGS
from keel.config.schema import CHOICES
from keel.config.yaml_text import FLOAT, INT

SECTION_TYPES = typing.get_type_hints(RunConfig)
HINTS: dict[str, Any] = {
    f"{section}.{f.name}": typing.get_type_hints(cls)[f.name]
    for section, cls in SECTION_TYPES.items()
    for f in dataclasses.fields(cls)
}
FAULT_RANKS = {
    "faults.nan_rank": 0,
    "faults.bitflip_rank": 0,
    "faults.sleep_rank": 0,
    "faults.noise_rank": -1,
    "faults.save_stall_rank": -1,
    "faults.checkpoint_dir_rank": -1,
    "faults.save_enospc_rank": -1,
    "faults.corrupt_state_rank": 0,
    "faults.preflight_bad_matmul_rank": -1,
    "faults.preflight_slow_rank": -1,
    "faults.preflight_slow_link_rank": -1,
    "faults.preflight_clock_skew_rank": -1,
}  # field: its lowest value


@dataclass
class Case:
    config: dict[str, Any] | str  # the YAML file: a mapping to dump, or raw text
    sets: list[str]
    ds: dict[str, Any] | str  # the DeepSpeed JSON: a mapping to dump, or raw text
    world: int
    # valid: each field set and what it must read back as
    values: dict[str, Any] = field(default_factory=dict)
    names: tuple[str, ...] = ()  # invalid: the error line names one of these
    ds_path: str = ""  # given instead of writing `ds` (a missing file, a directory)
    # the DeepSpeed JSON named by train.ds_config in the YAML instead of --ds-config
    ds_by_field: bool = False
    saved_config: str | None = None  # text of an existing run dir's config.yaml

    def put(self, name: str, value: Any, as_set: bool) -> None:
        """Set `name` (replacing any earlier setting) in the YAML mapping or as a `--set` string."""
        if as_set:
            self.put_text(name, set_text(value))
            return
        self.forget(name)
        section, key = name.split(".")
        self.config.setdefault(section, {})[key] = value

    def put_text(self, name: str, text: str) -> None:
        self.forget(name)
        self.sets.append(f"{name}={text}")

    def forget(self, name: str) -> None:
        section, key = name.split(".")
        self.sets = [item for item in self.sets if not item.startswith(f"{name}=")]
        if isinstance(self.config, dict) and isinstance(self.config.get(section), dict):
            self.config[section].pop(key, None)


def set_text(value: Any) -> str:
    """How a user writes `value` after `--set section.key=`: YAML flow text, a text field's text as typed."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        return (
            json.dumps(value, ensure_ascii=False)
            if isinstance(parsed, str) and parsed != value
            else value
        )
    return json.dumps(value, allow_nan=True, ensure_ascii=False)


# -- valid values of one field -----------------------------------------------------------------------------------
def int_range(bound: Bound) -> tuple[int, int]:
    low = (
        -INT64_MAX
        if bound.low is None
        else math.floor(bound.low) + 1
        if bound.low_open
        else math.ceil(bound.low)
    )
    high = (
        INT64_MAX
        if bound.high is None
        else math.ceil(bound.high) - 1
        if bound.high_open
        else math.floor(bound.high)
    )
    return low, high


def numbers(name: str, hint: Any) -> st.SearchStrategy:
    bound = BOUNDS[name]
    if hint is int:
        low, high = int_range(bound)
        return st.one_of(st.integers(low, min(high, low + 100)), st.integers(low, high))
    return st.floats(
        bound.low,
        bound.high,
        exclude_min=bound.low_open,
        exclude_max=bound.high_open,
        allow_nan=False,
        allow_infinity=False,
    )


# a user's PyYAML writes "0E0" unquoted (a YAML 1.1 string) and Keel reads config as YAML 1.2, where it is the float
# 0.0 (keel/config/yaml_text.py): such a path is refused in one line, so it is not a valid value
TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc", "Cn", "Zl", "Zp")),
    min_size=1,
    max_size=6,
).filter(lambda text: not (INT.match(text) or FLOAT.match(text)))
GLOBS = st.lists(TEXT, min_size=1, max_size=2)
WEIGHTED = st.lists(
    st.fixed_dictionaries(
        {
            "path": st.one_of(TEXT, GLOBS),
            "weight": st.one_of(st.floats(1e-9, 1e9), st.sampled_from([1e-5, 2.5e-4, 1, 0.5])),
        }
    ),
    min_size=1,
    max_size=2,
)
SPECIAL: dict[str, st.SearchStrategy] = {
    "data.corpus": st.one_of(st.just(["default"]), GLOBS, WEIGHTED),
    "data.skip_ranges": st.lists(
        st.tuples(st.integers(0, 10**9), st.integers(1, 10**6)).map(
            lambda r: f"{r[0]}:{r[0] + r[1]}"
        ),
        max_size=3,
    ),
    "data.tokenizer": st.just("train"),  # a tokenizer path is read by prepare_data
    "data.cache_dir": st.sampled_from(["~/.cache/keel", "cache", "/tmp/keel-fuzz-cache"]),
    "model.init_from": st.just(""),  # an HF directory is read by the checks
    "parallel.pipeline_partition": st.one_of(
        st.sampled_from(["parameters", "uniform"]), TEXT.map(lambda name: f"type:{name}")
    ),
    "faults.bitflip_param": st.one_of(st.just(""), TEXT),
    "faults.checkpoint_dir": st.one_of(st.just(""), TEXT),
    "faults.pause_file": st.one_of(st.just(""), TEXT),
}


@functools.cache  # a strategy is built once per field: building one costs more than drawing from it
def valid_values(name: str) -> st.SearchStrategy:
    """Values `name` admits on its own, from its type, choices and bound."""
    hint = HINTS[name]
    if name in SPECIAL:
        return SPECIAL[name]
    if name in CHOICES:
        return st.sampled_from(CHOICES[name])
    if hint is bool:
        return st.booleans()
    if hint in (int, float):
        return numbers(name, hint)
    if typing.get_origin(hint) is tuple:
        return st.tuples(*(numbers(name, arg) for arg in typing.get_args(hint)))
    if typing.get_origin(hint) is list:
        return st.lists(numbers(name, typing.get_args(hint)[0]), max_size=3)
    assert hint is str, name
    return TEXT


# -- the related fields, drawn together ----------------------------------------------------------------------------
# one draw seeds every number of a layout: hypothesis's cost is per draw
SEED = st.integers(0, 2**64 - 1)


class Picker:
    """Values from a generator seeded by one drawn integer (a hypothesis draw per value costs ~50 us each)."""

    def __init__(self, seed: int):
        self.random = random.Random(seed)

    def int(self, low: int, high: int) -> int:
        return self.random.randint(low, high)

    def one(self, options: list[Any]) -> Any:
        return options[self.int(0, len(options) - 1)]

    def coin(self) -> bool:
        return bool(self.int(0, 1))


@st.composite
def layouts(draw) -> tuple[dict[str, Any], int, dict[str, Any]]:
    """(field → value, world size, DeepSpeed JSON) satisfying every rule that relates fields."""
    pick = Picker(draw(SEED))
    tp, sp, pp = pick.one([1, 2, 4]), pick.one([1, 2]), pick.one([1, 2, 3])
    cp = pick.one([1, 2, 4])
    dp = pick.int(1, 4)
    ep = pick.one([e for e in (1, 2, 4) if dp % e == 0])
    kv = pick.one([1, 2, 4])
    n_heads = math.lcm(tp * sp, kv) * pick.int(1, 3)
    moe = ep > 1 or pick.coin()
    experts = ep * pick.int(2 if ep == 1 else 1, 4) if moe else 0
    n_layers = pick.int(max(1, pp - 3), 8)
    micro, ga = pick.int(1, 8), pick.int(1, 4)
    steps = pick.one([1, 2, 10, 300, 10**6, pick.int(1, 10**5)])
    values = {
        "model.n_kv_heads": kv,
        "model.n_heads": n_heads,
        "model.n_layers": n_layers,
        "model.dim": n_heads * 2 * pick.int(1, 16),  # head_dim even for RoPE
        "model.ffn_multiple_of": tp * pick.int(1, 64),
        "model.ffn_hidden": pick.one([0, tp * pick.int(1, 512)]),
        "model.moe_experts": experts,
        "model.moe_top_k": pick.int(1, min(2, experts) if experts else 2),
        "model.moe_every": pick.int(1, n_layers),
        "model.moe_ffn_hidden": pick.one([0, tp * pick.int(1, 512)]),
        # cp: 2·cp chunks, each rank's s/cp tokens split over sp (× tp under SP)
        "data.seq_len": (2 * cp if cp > 1 else 1) * sp * tp * pick.int(1, 64),
        "data.document_mask": pp == 1 and sp == 1 and pick.coin(),
        # byte fallback needs 300 when training
        "data.tokenizer_vocab_size": pick.int(300, 1 << 20),
        "parallel.tp": tp,
        "parallel.pp": pp,
        "parallel.sp": sp,
        "parallel.cp": cp,
        "parallel.ep": ep,
        "parallel.sequence_parallel": tp > 1 and pick.coin(),
        "train.micro_batch_size": micro,
        "train.global_batch_size": micro * dp * ga,
        "train.steps": steps,
        "train.warmup_steps": pick.int(0, steps),
        "faults.starve_expert": pick.int(-1, experts - 1),
    }
    if ga > 1 and pick.coin():
        values["train.rampup_start_batch"] = micro * dp * pick.int(1, ga - 1)
        values["train.rampup_steps"] = pick.int(1, 1000)
    first_micro_batches = values.get("train.rampup_start_batch", micro * dp * ga) // (micro * dp)
    schedules, chunks = ["1f1b"], pick.int(2, 4)
    # both run on DeepSpeed's DualPipeVEngine
    if pp > 1 and not moe and first_micro_batches >= 2 * pp:
        schedules += ["dualpipev"] if 2 * pp <= n_layers + 3 else []
        # interleaved: groups of pp
        grouped = ga % pp == 0 and "train.rampup_start_batch" not in values
        schedules += ["interleaved"] if grouped and chunks * pp <= n_layers + 3 else []
    values["parallel.pipeline_schedule"] = schedule = pick.one(schedules)
    values["parallel.virtual_stages"] = chunks
    values["train.eval_batches"] = pp * pick.int(2, 3) if schedule != "1f1b" else pick.int(1, 8)
    world = tp * pp * cp * sp * dp
    for name, lowest in FAULT_RANKS.items():
        values[name] = pick.int(lowest, world - 1)
    # a pause needs the file that ends it
    values["faults.pause_step"] = pause = pick.one([0, pick.int(1, steps)])
    values["faults.pause_file"] = pick.one(
        ["go", "/tmp/keel-fuzz-go"] + ([""] if not pause else [])
    )
    # model.fp8: the MX formats need every per-rank GEMM extent a multiple of their 32-element block
    head_dim = values["model.dim"] // n_heads
    ffn = (
        values["model.ffn_hidden"]
        or -(-(8 * values["model.dim"] // 3) // values["model.ffn_multiple_of"])
        * values["model.ffn_multiple_of"]
    )
    extents = [
        values["model.dim"],
        values["model.dim"] // tp,
        ffn // tp,
        micro * values["data.seq_len"] // (sp * cp),
    ]
    if kv % tp == 0:
        extents.append(kv * head_dim // tp)
    mx_fits = all(extent % 32 == 0 for extent in extents)
    values["model.fp8"] = fp8 = pick.one(
        ["off", "tensorwise", "rowwise", "rowwise_gw_hp"] + (["mxfp8", "mxfp4"] if mx_fits else [])
    )
    # some blocks must stay in FP8
    values["model.fp8_skip_blocks"] = pick.int(0, (n_layers - 1) // 2 if fp8 != "off" else 8)
    stage = pick.one([0, 1] if pp > 1 else [0, 1, 2] if moe else [0, 1, 2, 3])
    plain = (
        not moe and tp == pp == sp == cp == 1 and stage < 3
    )  # where model.compile=true is supported
    values["model.compile"] = pick.one(
        sorted(COMPILE_SETTINGS) if plain else ["auto", "false", "off", "no", "0"]
    )
    return values, world, deepspeed_config(pick, stage, values, ga)


def deepspeed_config(pick: Picker, stage: int, values: dict[str, Any], ga: int) -> dict[str, Any]:
    """A DeepSpeed JSON for `stage` whose explicit values agree with the run (else "auto")."""
    ds: dict[str, Any] = {
        "train_batch_size": pick.one(["auto", values["train.global_batch_size"]]),
        "train_micro_batch_size_per_gpu": pick.one(["auto", values["train.micro_batch_size"]]),
        "gradient_accumulation_steps": pick.one(["auto", ga]),
        "steps_per_print": pick.int(1, 10**6),
        "zero_optimization": {"stage": stage},
    }
    if pick.coin():
        ds["zero_optimization"].update(
            reduce_bucket_size=pick.int(1, 10**6), contiguous_gradients=pick.coin()
        )
    precision = pick.one(
        ["fp32", "bf16", "fp16", "fp16-off"] if stage else ["fp32", "bf16", "fp16-off"]
    )
    if precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": pick.int(1, 32)}
    elif precision == "fp16-off":
        ds["fp16"] = {"enabled": False}
    if pick.coin():
        ds["optimizer"] = {"type": pick.one(["AdamW", "Adam", "adamw"]), "params": {"lr": "auto"}}
    return ds


LISTS = sorted(name for name, hint in HINTS.items() if typing.get_origin(hint) in (list, tuple))
INDEPENDENT = sorted(
    name for name in HINTS if name not in ("train.ds_config", "train.rampup_start_batch")
)


@st.composite
def valid_cases(draw, extra: int = 8, lists: bool = True) -> Case:
    """A layout plus up to `extra` other fields (and, if `lists`, each list field as often as not)."""
    values, world, ds = draw(layouts())
    names = draw(
        st.lists(
            st.sampled_from([n for n in INDEPENDENT if n not in values]),
            max_size=extra,
            unique=True,
        )
    )
    names += [name for name in LISTS if lists and name not in names and draw(st.booleans())]
    for name in names:
        values[name] = draw(valid_values(name))
    # the rules that relate a drawn field to another
    if values.get("model.deepnorm"):
        values["model.norm_placement"] = "post"  # DeepNet is post-norm
    if 0 < values.get("stability.attn_logit_growth", 0) <= 1:
        # a growth factor is > 1 (0: off); +1 can round to 1.0
        values["stability.attn_logit_growth"] += 1.5
    case = Case({}, [], ds, world)
    # bit i: the i-th field as --set (one draw, not one each)
    channels = draw(st.integers(0, 2 ** len(values) - 1))
    for i, (name, value) in enumerate(values.items()):
        as_set = bool(channels >> i & 1)
        if as_set and name == "data.skip_ranges" and value:
            case.put_text(name, ",".join(value))  # as typed: --set data.skip_ranges=100:200,300:400
        else:
            case.put(name, value, as_set)
    case.values = values
    case.ds_by_field = draw(st.booleans())
    return case
