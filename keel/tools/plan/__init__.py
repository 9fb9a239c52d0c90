"""`keel plan`: which layout to use for a model on N devices, whether it fits, and how fast it will go.

search.py enumerates the layouts `keel train` accepts, predict.py predicts each (memory from the memory model,
step time by term), devices.py holds the devices' figures. The plan's error is measured by
bench/plan_accuracy.py (this machine's runs, and published runs on GPUs).
"""

from __future__ import annotations

import json
from pathlib import Path

from keel.config import RunConfig
from keel.data import expected_vocab_size
from keel.tools.plan.predict import Prediction
from keel.tools.plan.search import Plans

GIB = 2**30


def resolve_vocab(cfg: RunConfig, base_dir: Path) -> None:
    """model.vocab_size 0 (the tokenizer's) as a run will have it, without preparing data: the tokenizer file's
    size, else the size a trained tokenizer is asked for (the embedding and head are in every plan)."""
    if not cfg.model.vocab_size:
        data = cfg.data
        cfg.model.vocab_size = expected_vocab_size(
            data.tokenizer, data.tokenizer_vocab_size, base_dir
        )


def describe(p: Prediction) -> str:
    layout = p.layout
    shape = f"tp{layout['tp']} pp{layout['pp']} dp{layout['dp']}"
    shape += "".join(f" {k}{layout[k]}" for k in ("cp", "sp", "ep") if layout[k] > 1)
    if layout["pp"] > 1:
        shape += f" {layout['schedule']}"
    shape += f" zero{layout['zero']} mb{layout['micro_batch']}"
    return shape + (" ckpt" if layout["checkpointing"] else "")


def table(plans: Plans, top: int) -> str:
    """The top plans with their breakdown, then the closest that do not fit, then the rejected families."""
    lines = []
    if plans.ranked:
        head = (
            f"{'#':>2}  {'layout':<38} {'GiB/rank':>9} {'step s':>8} {'tok/s/dev':>10} {'MFU':>6} "
            f"{'MFU-noattn':>10}  binding / terms (s)"
        )
        lines.append(head)
        for i, p in enumerate(plans.ranked[:top], 1):
            terms = ", ".join(f"{k} {v:.3g}" for k, v in p.terms.items() if v >= 0.005 * p.step_s)
            lines.append(
                f"{i:>2}  {describe(p):<38} {p.memory.peak / GIB:>9.3g} {p.step_s:>8.3g} "
                f"{p.tokens_per_s_per_device:>10.4g} {p.mfu():>6.1%} {p.mfu(False):>10.1%}  "
                f"{p.binding} / {terms}"
            )
    else:
        lines.append("no layout fits")
    for p in plans.too_big[:3]:
        over = p.memory.peak - p.memory_limit
        lines.append(
            f"does not fit: {describe(p)} needs {p.memory.peak / GIB:.3g} GiB per rank, "
            f"{over / GIB:.3g} GiB over the {p.memory_limit / GIB:.3g} GiB it may use "
            f"(state {p.memory.total / GIB:.3g}, activations {p.memory.activations / GIB:.3g})"
        )
    if plans.rejected:
        count = sum(len(families) for families in plans.rejected.values())
        lines.append(f"refused by keel train's checks ({count} layouts, by reason):")
        for reason, families in sorted(plans.rejected.items(), key=lambda kv: -len(kv[1]))[:8]:
            lines.append(f"  {len(families):>4} × (e.g. {families[0]}) {reason}")
    return "\n".join(lines)


def write(plan: Prediction, path: Path) -> list[str]:
    """`--write OUT`: the `--set` items, one per line, and beside them the DeepSpeed JSON (OUT.ds.json)."""
    ds_path = path.with_suffix(".ds.json")
    ds_path.write_text(json.dumps(plan.ds, indent=2) + "\n")
    items = [*plan.overrides, f"train.ds_config={ds_path.resolve()}"]
    path.write_text("".join(f"--set {item}\n" for item in items))
    return items
