"""`keel plan`'s prediction against a run on one GPU: the plan's best layout for a ~1B model at seq 4096 is
trained for a few steps and its tokens/s and peak memory are compared with what the plan said.

Run by bench/device_check.sh (stage `plan`) on a lent GPU; the device is the table's (`--device`), not
measured, so the error is the planner's as a user meets it.

    python bench/plan_gpu.py [--device h200] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from keel.config import clamp_warmup, load_config  # noqa: E402
from keel.engine.ds_config import load_ds_config  # noqa: E402
from keel.tools.plan import describe, resolve_vocab  # noqa: E402
from keel.tools.plan.devices import DEVICES  # noqa: E402
from keel.tools.plan.search import make_plans  # noqa: E402
from keel.training.observe.metrics import read_metrics  # noqa: E402
from tests.keel_runs import keel_train  # noqa: E402

GIB = 2**30
# two ~1B models at seq 4096, global batch 32 (a step of a second or two): the plan picks the rest
MODELS = {
    "llama 1.2B (dim 2048, 16 layers)": ["data.seq_len=4096", "train.global_batch_size=32"],
    "llama 0.9B (dim 1536, 24 layers)": [
        "data.seq_len=4096",
        "train.global_batch_size=32",
        "model.dim=1536",
        "model.n_layers=24",
        "model.n_heads=24",
    ],
}
RUN = ["data.corpus=[default]", "train.eval_interval=0", "checkpoint.interval=0"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h200", choices=sorted(DEVICES))
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    print(
        f"{'model':<34} {'plan':<36} {'tok/s pred':>10} {'measured':>9} {'error':>7} "
        f"{'GiB pred':>8} {'measured':>8} {'error':>7}"
    )
    for name, sets in MODELS.items():
        cfg = load_config(str(REPO / "configs/llama_1b.yaml"), [*sets, *RUN])
        clamp_warmup(cfg.train)
        resolve_vocab(cfg, REPO / "configs")
        ds = load_ds_config(REPO / cfg.train.ds_config)
        plans = make_plans(cfg, ds, 1, 1, DEVICES[args.device], set())
        if not plans.ranked:
            print(f"{name:<34} no plan fits")
            continue
        plan = plans.ranked[0]
        with tempfile.TemporaryDirectory(prefix="keel-plan-gpu-") as tmp:
            ds_path = Path(tmp) / "ds.json"
            ds_path.write_text(json.dumps(plan.ds))
            items = [
                *sets,
                *RUN,
                *plan.overrides,
                f"train.steps={args.steps}",
                "logging.log_interval=1",
                f"train.ds_config={ds_path}",
            ]
            try:
                keel_train(
                    Path(tmp) / "run",
                    1,
                    items,
                    str(ds_path),
                    timeout=900,
                    config=REPO / "configs/llama_1b.yaml",
                )
            except AssertionError as failed:  # its exit code and the log's tail
                print(f"{name:<34} {describe(plan):<36} run failed: {str(failed)[-3000:]}")
                continue
            records = read_metrics(Path(tmp) / "run" / "metrics.jsonl")
            if len(records) < 4:
                print(f"{name:<34} {describe(plan):<36} only {len(records)} step(s) recorded")
                continue
            tokens = statistics.median(r["tokens_per_s"] for r in records[2:])
            peak = max(r.get("gpu_mem_peak_gib", 0.0) for r in records)
        predicted_peak = plan.memory.peak / GIB
        print(
            f"{name:<34} {describe(plan):<36} {plan.tokens_per_s_per_device:>10,.0f} {tokens:>9,.0f} "
            f"{plan.tokens_per_s_per_device / tokens - 1:>+7.1%} {predicted_peak:>8.3g} {peak:>8.3g} "
            f"{predicted_peak / peak - 1 if peak else float('nan'):>+7.1%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
