"""Peak GPU memory of a finished run next to Keel's memory model (bench/device_check.sh prints one line per run).

Usage: python bench/memory_vs_model.py RUN_DIR. The measured figure is the largest `gpu_mem_peak_gib` the trainer
recorded (torch's allocator peak, activations and temporaries included); the model predicts the persistent state
(parameters, gradients, optimizer state, buckets), so measured − model is roughly the activations' share.
"""

from __future__ import annotations

import sys
from pathlib import Path

from keel.engine.memory_model import Layout, estimate
from keel.run_dir import read_run_dir
from keel.training.observe.metrics import read_metrics

GIB = 2**30


def main(run_dir: Path) -> None:
    cfg, ds, _ = read_run_dir(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    peaks = [r["gpu_mem_peak_gib"] for r in records if "gpu_mem_peak_gib" in r]
    p = cfg.parallel
    batch = [
        ds.get(k)
        for k in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
        )
    ]
    # resolved in the run
    dp = batch[0] // (batch[1] * batch[2]) if all(isinstance(v, int) for v in batch) else 1
    model = estimate(cfg, ds, Layout(tp=p.tp, pp=p.pp, dp=dp, ep=p.ep, sp=p.sp, cp=p.cp))
    measured = f"{max(peaks):.3f} GiB" if peaks else "n/a (no CUDA peak recorded)"
    print(
        f"{run_dir.name}: ZeRO-{model.stage} {model.precision} | model: params {model.params / GIB:.3f} + grads "
        f"{model.grads / GIB:.3f} + optimizer {model.optimizer / GIB:.3f} + buckets {model.buckets / GIB:.3f} = "
        f"{model.total / GIB:.3f} GiB | measured peak {measured}"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
