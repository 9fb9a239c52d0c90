"""Invalid run configs for the config fuzzer: a valid case (tests/faults/config_cases.py) with one thing broken,
and the names its one-line error may give (the field broken, or for a rule relating fields, one of them)."""

from __future__ import annotations

import math
import typing
from typing import Any

from hypothesis import strategies as st

from keel.config.bounds import BOUNDS, INT64_MAX
from keel.config.schema import CHOICES
from tests.faults.config_cases import (
    FAULT_RANKS,
    HINTS,
    SECTION_TYPES,
    Case,
    int_range,
    valid_cases,
)

# -- bad values of one field, as YAML objects (the config file) and as --set text ---------------------------------
NOT_A_NUMBER = [
    math.nan,
    math.inf,
    -math.inf,
    "1e400",
    "-1e400",
    "nan",
    "abc",
    "",
    None,
    True,
    False,
    [1],
    {"a": 1},
]
NOT_A_NUMBER_TEXT = [
    "nan",
    ".nan",
    "NaN",
    "inf",
    ".inf",
    "-.inf",
    "1e400",
    "-1e400",
    "abc",
    "",
    "null",
    "~",
    "true",
    "off",
    "[1]",
    "{a: 1}",
    "1,2",
    "0x",
    "1e",
    "--1",
]
BROKEN_YAML = [
    "[",
    "{",
    "[1, 2",
    "{a: 1",
    "'x",
    '"x',
    "a: b: c",
    "*x",
    "&a",
    "]",
    "}",
    "@x",
    "`x",
    "[1,\n",
    "!!python/object/apply:os.system ['true']",
    "- [",
    "{a: [}",
]
NOT_A_BOOL = ["maybe", 2, -1, 0.5, None, [True], {}, "", "yes please", math.nan]
NOT_A_BOOL_TEXT = ["maybe", "2", "-1", "0.5", "null", "[true]", "{}", "", "truee", ".nan"]
NOT_TEXT = [
    None,
    ["a"],
    {"a": "b"},
]  # a text field takes any --set text; in a YAML file these are mistakes
LIST_BREAKS: dict[str, tuple[list[Any], list[str]]] = {
    "data.corpus": (
        [
            [],
            [""],
            [None],
            [1],
            [["a"]],
            ["a", {"path": "b", "weight": 1}],
            [{"path": "a"}],
            [{"path": "a", "weight": -1}],
            [{"path": "a", "weight": math.nan}],
            [{"path": "a", "weight": math.inf}],
            [{"path": "a", "weight": "x"}],
            [{"path": "a", "weight": True}],
            [{"path": "a", "weight": 0}],
            [{"path": [], "weight": 1}],
            [{"path": "a", "weight": 1, "extra": 2}],
            [{"path": None, "weight": 1}],
            {"a": 1},
            None,
        ],
        [
            "[]",
            "[1]",
            "[null]",
            "[{path: a}]",
            "[{path: a, weight: -1}]",
            "[{path: a, weight: .nan}]",
            "[a, {path: b, weight: 1}]",
            "[{path: a, weight: x}]",
            "[{path: a, weight: 1e400}]",
            "[[a]]",
        ],
    ),
    "data.skip_ranges": (
        [
            ["abc"],
            ["5"],
            ["3:1"],
            ["7:7"],
            ["a:b"],
            ["1:2:3"],
            ["-1:5"],
            [None],
            [1.5],
            [[1, 2]],
            ["1.5:3"],
            [":"],
            [""],
        ],
        ["abc", "5", "300:100", "7:7", "a:b", "1:2:3", "-1:5", "[null]", "[1.5]", "[[1, 2]]", ":"],
    ),
    "faults.spike_steps": (
        [["x"], [0], [math.nan], [None], [1.5], [-3], [[1]], "x"],
        ["[1,", "x", "0", "[.nan]", "1,abc", "[-1]", "[1e400]", "[[1]]"],
    ),
    "train.betas": (
        [
            [0.9],
            [0.9, 0.95, 0.99],
            [math.nan, 0.9],
            [1.0, 0.9],
            [-0.1, 0.9],
            "x",
            None,
            [True, 0.9],
            [0.9, math.inf],
            [[0.9], 0.9],
        ],
        ["0.9", "[0.9]", "x,y", "[1e400, 0.9]", "[0.9,", "[.nan, 0.9]", "[0.9, 1]", "[null, 0.9]"],
    ),
}


def typo(draw, word: str, avoid: typing.Iterable[str]) -> str:
    """`word` with one letter inserted, dropped, changed or its case flipped; never one of `avoid`."""
    letters = st.sampled_from("abcdefghijklmnopqrstuvwxyz_")
    i = draw(st.integers(0, max(0, len(word) - 1)))
    kind = draw(st.sampled_from(["insert", "drop", "change", "case"] if word else ["insert"]))
    if kind == "insert":
        out = word[:i] + draw(letters) + word[i:]
    elif kind == "drop":
        out = word[:i] + word[i + 1 :]
    elif kind == "change":
        out = word[:i] + draw(letters.filter(lambda c: c != word[i])) + word[i + 1 :]
    else:
        out = word.swapcase() if word.lower() != word.upper() else word + "x"
    return out if out not in set(avoid) and out else word + "_x"


def out_of_bounds(draw, name: str) -> Any:
    """A number of the field's type outside its bound (or past 64 bits)."""
    bound, hint = BOUNDS[name], HINTS[name]
    if typing.get_origin(hint) in (list, tuple):
        hint = typing.get_args(hint)[0]
    sides = [s for s in ("low", "high") if getattr(bound, s) is not None]
    side = draw(st.sampled_from(sides + ["huge"] if hint is int else sides))
    if hint is int:
        low, high = int_range(bound)
        return {
            "low": low - draw(st.integers(1, 10**6)),
            "high": high + draw(st.integers(1, 10**6)),
            "huge": INT64_MAX + draw(st.integers(1, 10**20)),
        }[side]
    gap = draw(st.floats(1e-3, 1e6))
    if side == "low":
        return bound.low if bound.low_open else bound.low - gap
    return bound.high if bound.high_open else bound.high + gap


@st.composite
def field_breaks(draw) -> tuple[str, Any, bool]:
    """(field, bad value, whether the value is --set text)."""
    name = draw(st.sampled_from(sorted(n for n in HINTS if n != "train.ds_config")))
    hint, as_set = HINTS[name], draw(st.booleans())
    if name in LIST_BREAKS:
        objects, texts = LIST_BREAKS[name]
        if draw(st.booleans()) and name in BOUNDS:
            bad = out_of_bounds(draw, name)
            return name, [bad, bad] if name == "train.betas" else [bad], False
        return name, draw(st.sampled_from(texts if as_set else objects)), as_set
    if name in CHOICES:
        choices = CHOICES[name]
        bad = (
            typo(draw, draw(st.sampled_from(choices)), choices)
            if draw(st.booleans())
            else draw(st.sampled_from([None, 3, ["x"], {"a": 1}, math.nan]))
        )
        if as_set and not isinstance(bad, str):
            return name, draw(st.sampled_from(["null", "3", "[x]", "{a: 1}", ".nan"])), True
        return name, bad, as_set
    if hint is bool:
        return name, draw(st.sampled_from(NOT_A_BOOL_TEXT if as_set else NOT_A_BOOL)), as_set
    if hint in (int, float):
        kind = draw(
            st.sampled_from(["bounds", "nasty", "broken"] + (["fraction"] if hint is int else []))
        )
        if kind == "bounds":
            return name, out_of_bounds(draw, name), False
        if kind == "fraction":
            return name, draw(st.sampled_from([1.5, "2.5", -0.5, 1e-9 + 3, 2**0.5])), False
        if kind == "broken":
            return name, draw(st.sampled_from(BROKEN_YAML)), True
        return name, draw(st.sampled_from(NOT_A_NUMBER_TEXT if as_set else NOT_A_NUMBER)), as_set
    if name == "model.compile":
        return name, draw(st.sampled_from(["maybe", "ture", "auto_", "2"])), as_set
    if name == "parallel.pipeline_partition":
        return name, draw(st.sampled_from(["param", "Uniform", "type", "layers", ""])), as_set
    return name, draw(st.sampled_from(NOT_TEXT)), False


def relation_breaks(draw, case: Case) -> tuple[str, ...]:
    """Break a rule that relates fields; the names it may give."""
    v = case.values
    tp, pp, sp = v["parallel.tp"], v["parallel.pp"], v["parallel.sp"]
    # (a warmup longer than the run is no longer an error: `keel train` clamps it with a warning)
    options = ["kv", "head_dim", "pp", "fault_rank", "moe_one", "starve"]
    if v["train.micro_batch_size"] * case.world // (tp * pp * sp) > 1:
        options.append("batch")
    if tp * pp * sp > 1:
        options.append("world")
    kind = draw(st.sampled_from(options))
    n_heads = v["model.n_heads"]
    if kind == "batch":
        unit = v["train.micro_batch_size"] * case.world // (tp * pp * sp)
        case.put(
            "train.global_batch_size",
            v["train.global_batch_size"] + draw(st.integers(1, unit - 1)),
            False,
        )
        return ("train.global_batch_size",)
    if kind == "kv":
        case.put("model.n_kv_heads", n_heads + draw(st.integers(1, 5)), draw(st.booleans()))
        return ("model.n_kv_heads",)
    if kind == "head_dim":
        case.put("model.dim", n_heads * (2 * draw(st.integers(0, 8)) + 1), draw(st.booleans()))
        return ("model.dim",)
    if kind == "pp":
        new_pp = v["model.n_layers"] + 3 + draw(st.integers(1, 3))
        case.put("parallel.pp", new_pp, False)
        case.world = case.world // pp * new_pp  # the same data-parallel size
        return (
            "parallel.pp",
            "parallel.sp",
            "parallel",
            "zero_optimization.stage",
            "document_mask",
        )
    if kind == "world":
        case.world = case.world + draw(st.sampled_from([w for w in range(1, tp * pp * sp)]))
        return ("parallel", "WORLD_SIZE", "world size")
    if kind == "fault_rank":
        name = draw(st.sampled_from(sorted(FAULT_RANKS)))
        case.put(name, case.world + draw(st.integers(0, 10)), draw(st.booleans()))
        return (name,)
    if kind == "moe_one":
        case.put("model.moe_experts", 1, False)
        return ("model.moe_experts", "parallel.ep", "faults.starve_expert")
    case.put(
        "faults.starve_expert", max(v["model.moe_experts"], 0) + draw(st.integers(0, 3)), False
    )
    return ("faults.starve_expert",)


# -- the DeepSpeed JSON --------------------------------------------------------------------------------------------
NEAR_MISSES = [
    "zero_optimisation",
    "train_batch",
    "gradient_clip",
    "bf_16",
    "fp_16",
    "optimiser",
    "train_micro_batch_size",
    "gradient_accumulation",
    "steps_per_prints",
    "zero_optimization_stage",
]
TYPED_KEYS = [
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "steps_per_print",
    "gradient_clipping",
    "wall_clock_breakdown",
]
DS_SECTIONS = [
    "zero_optimization",
    "fp16",
    "bf16",
    "bfloat16",
    "optimizer",
    "tensorboard",
    "pipeline",
]
NOT_A_MAPPING = [[], [1], "3", 3, None, True, "yes"]
BAD_JSON = [
    "{",
    "[1, 2]",
    "3",
    "null",
    '"x"',
    "",
    '{"a": }',
    "{'a': 1}",
    '{"zero_optimization": {"stage": 1}',
]


def ds_breaks(draw, case: Case) -> tuple[str, ...]:
    """Break the DeepSpeed JSON; the names the error may give."""
    ds = case.ds
    assert isinstance(ds, dict)
    stage = ds["zero_optimization"]["stage"]
    kind = draw(
        st.sampled_from(
            [
                "json",
                "path",
                "section",
                "stage",
                "enabled",
                "near_miss",
                "disagree",
                "scheduler",
                "optimizer",
                "nested",
                "both_precisions",
            ]
        )
    )
    if kind == "json":
        case.ds = draw(st.sampled_from(BAD_JSON))
        return ("train.ds_config",)
    if kind == "path":
        case.ds_path = draw(st.sampled_from(["/nonexistent/ds.json", "/tmp", "\x00"]))
        return ("train.ds_config", "--ds-config")
    if kind == "section":
        name = draw(st.sampled_from(DS_SECTIONS))
        ds[name] = draw(st.sampled_from(NOT_A_MAPPING))
        return (name,)
    if kind == "stage":
        ds["zero_optimization"]["stage"] = draw(
            st.sampled_from(["abc", 4, -1, 1.5, "1", True, None, [], math.nan])
        )
        return ("zero_optimization.stage",)
    if kind == "enabled":
        name = draw(st.sampled_from(["fp16", "bf16", "bfloat16"]))
        ds.pop("fp16", None)
        ds[name] = {
            "enabled": draw(
                st.sampled_from(["false", "true", "False", 1, 0, None, "auto", [], 0.0])
            )
        }
        return (f"{name}.enabled",)
    if kind == "near_miss":
        name = draw(st.sampled_from(NEAR_MISSES))
        ds[name] = draw(st.sampled_from([{"stage": 3}, 16, 1.0, {"enabled": True}, "auto"]))
        return (name,)
    if kind == "disagree":
        name = draw(st.sampled_from(TYPED_KEYS[:3] + ["gradient_clipping"]))
        ds[name] = draw(st.sampled_from(["abc", -1, 1000007.5, True, None, [16], math.nan]))
        return (name,)
    if kind == "scheduler":
        ds["scheduler"] = draw(st.sampled_from([{"type": "WarmupLR"}, {}, None, []]))
        return ("scheduler",)
    if kind == "optimizer":
        bad = draw(
            st.sampled_from(
                [
                    {"type": "Lamb"},
                    {"type": None},
                    {"type": 3},
                    {"type": "AdamW", "params": []},
                    {"type": "AdamW", "params": {"lr": -1}},
                    {"type": "AdamW", "params": "x"},
                    {"type": "AdamW", "params": {"betas": [0.1, 0.2]}},
                    {"params": {}},
                ]
            )
        )
        ds["optimizer"] = bad
        return ("optimizer",)
    if kind == "nested":
        zero = ds["zero_optimization"]
        key = draw(
            st.sampled_from(["reduce_bucket_size", "stagee", "contiguous_gradient", "overlap_comm"])
        )
        zero[key] = draw(st.sampled_from(["abc", [], {"a": 1}, -2.5]))
        return (key,)
    ds["fp16"], ds["bf16"] = {"enabled": True}, {"enabled": True}
    if stage == 0:
        ds["zero_optimization"]["stage"] = 1
    return ("fp16.enabled", "bf16.enabled")


# -- whole cases ---------------------------------------------------------------------------------------------------
@st.composite
def invalid_cases(draw) -> Case:
    # the breakage is the point: a small base draws fast
    case = draw(valid_cases(extra=2, lists=False))
    kind = draw(
        st.sampled_from(
            ["field"] * 6
            + ["relation"] * 2
            + ["ds"] * 3
            + ["key", "section", "mapping", "file", "set_syntax", "saved"]
        )
    )
    sections = list(SECTION_TYPES)
    if kind == "field":
        name, bad, as_set = draw(field_breaks())
        if as_set:
            case.put_text(name, bad)
        else:
            case.put(name, bad, False)
        case.names = (name,)
    elif kind == "relation":
        case.names = relation_breaks(draw, case)
    elif kind == "ds":
        case.names = ds_breaks(draw, case)
    elif kind == "key":
        section = draw(st.sampled_from(sections))
        keys = [n.split(".")[1] for n in HINTS if n.startswith(section + ".")]
        key = typo(draw, draw(st.sampled_from(keys)), keys)
        case.put(
            f"{section}.{key}", draw(st.sampled_from([1, "x", True, None])), draw(st.booleans())
        )
        case.names = (f"{section}.{key}",)
    elif kind == "section":
        section = typo(draw, draw(st.sampled_from(sections)), sections)
        case.config[section] = {"x": 1}
        case.names = (section,)
    elif kind == "mapping":
        section = draw(st.sampled_from(sections))
        case.config[section] = draw(st.sampled_from([[1], 3, "abc", True, ["a", "b"], 1.5]))
        case.names = (section,)
    elif kind == "file":
        case.config = draw(
            st.sampled_from(
                [
                    "- a\n- b\n",
                    "3\n",
                    "just text\n",
                    "model: [unclosed\n",
                    "model:\n  dim: 1\n dim: 2\n",
                    "model: {dim: 1\n",
                    "[\n",
                ]
            )
        )
        case.names = ("config",)
    elif kind == "set_syntax":
        case.sets.append(
            draw(
                st.sampled_from(
                    [
                        "train.steps",
                        "steps=5",
                        "a.b.c=1",
                        "=5",
                        "train..steps=1",
                        "train.steps:5",
                        ".steps=1",
                    ]
                )
            )
        )
        case.names = ("--set",)
    else:
        case.put("checkpoint.resume", True, True)
        case.saved_config = draw(
            st.sampled_from(
                [
                    "model: [\n",
                    "- a\n",
                    "model:\n  dim: abc\n",
                    "model: 3\n",
                    "model:\n  dimm: 4\n",
                    ": :\n",
                    "model:\n  dim: .nan\n",
                ]
            )
        )
        case.names = ("config.yaml",)
    return case
