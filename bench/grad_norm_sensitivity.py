"""How far fp32 rounding-sized weight differences move later gradient norms in the tests' tiny setup.

The equivalence tests compare per-step gradient norms of parallel runs with the single-process run. A parallel
run reduces in another order, so its weights differ from the reference's by fp32 rounding after the first update.
This measures the reference's own sensitivity to that: initial weights perturbed by 1e-7 and 3e-7 relative, same
data, torch AdamW with the tests' settings (tests/keel_runs.py TINY: 4 micro-batches of 2 accumulated per step), one
process — on random tokens and on the tests' own batches (their stdlib corpus, 512-token vocabulary, seed-1234
sample order). Its largest per-step ratio bounds the tolerance the tests may ask of steps after the first
(tests/test_train_equivalence.py).

Then the same with perturbations of a low-precision format's unit roundoff u (bf16 2^-8, fp16 2^-11), on the tests'
batches and model seed: how far the fp32 run's loss and gradient norm move when every weight is off by about one
rounding in that format, per step and as a multiple of u. At step 1 the change is linear in u; later it is not (the
trajectories part). These set the mixed-precision bounds of tests/test_train_equivalence.py.

Last, perturbations of 1e-7 to 3e-7 under model.fp8 (emulated): an FP8 cast rounds to 3 mantissa bits, so a
value that an fp32 rounding moves across a rounding boundary moves by a whole FP8 step, and a parallel FP8 run
parts from its reference faster than a high-precision one. Its losses and gradient norms after step 1 set the
later-step bounds of tests/test_fp8_training.py.

    python bench/grad_norm_sensitivity.py        # all of it
    python bench/grad_norm_sensitivity.py fp8    # the FP8 part only
"""

from __future__ import annotations

import dataclasses
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from keel.config import ModelConfig, RunConfig
from keel.data import GlobalSampleOrder, IndexedDataset, PackedSamples, ensure_prepared, step_batch
from keel.model.llama import CausalLM
from keel.model.param_groups import weight_decay_groups

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, tie_embeddings=True)
MOE_CFG = dataclasses.replace(CFG, moe_experts=4)  # tests/test_moe_training.py MOE
STEPS, LR, WARMUP = 10, 0.01, 2
GLOBAL_BATCH, MICRO_BATCH, SEQ = 8, 2, 32
PERTURBATIONS = (1e-7, 3e-7)
# FP8's response to a perturbation is a few rounding flips, so it is erratic in eps: more draws
FP8_PERTURBATIONS = (1e-7, 1.5e-7, 2e-7, 2.5e-7, 3e-7)
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}  # 2^-p for p significand bits (8 and 11)


def grad_norms(
    cfg: ModelConfig, seed: int, perturbation: float, data: list[list[torch.Tensor]]
) -> list[float]:
    """Per-step clipped-gradient norms; `data[step]` is that step's micro-batches (tokens + next-token labels)."""
    return train(cfg, seed, perturbation, data)[1]


def train(
    cfg: ModelConfig, seed: int, perturbation: float, data: list[list[torch.Tensor]]
) -> tuple[list[float], list[float]]:
    """Per-step (losses, clipped-gradient norms); the loss is the mean over the step's micro-batches."""
    model = CausalLM(cfg, seed=seed)
    if perturbation:
        noise = torch.Generator().manual_seed(123)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1 + perturbation * torch.randn(param.shape, generator=noise))
    optimizer = torch.optim.AdamW(
        weight_decay_groups(model, 0.1), lr=LR, betas=(0.9, 0.95), eps=1e-8
    )
    losses, norms = [], []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = LR * min(1.0, (step + 1) / WARMUP)
        optimizer.zero_grad()
        loss = 0.0
        for batch in data[step]:
            micro = model(batch[:, :-1], labels=batch[:, 1:]) / len(data[step])
            micro.backward()
            loss += micro.item()
        losses.append(loss)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
    return losses, norms


def random_batches() -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=generator)
    return [list(step.split(MICRO_BATCH)) for step in tokens]


def test_batches(cache_dir: Path) -> list[list[torch.Tensor]]:
    """The batches the tests' single-process reference trains on (tests/conftest.py small_corpus)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [str(stdlib / name / "*.py") for name in ("json", "email", "http")]
    prepared = ensure_prepared(corpus, cache_dir, CFG.vocab_size, progress=False)
    defaults = RunConfig()
    samples = PackedSamples(
        IndexedDataset(prepared.data_prefix), SEQ, "train", defaults.data.val_fraction
    )
    order = GlobalSampleOrder(len(samples), defaults.train.seed)
    return [
        step_batch(order, samples, step * GLOBAL_BATCH, GLOBAL_BATCH, MICRO_BATCH, 0, 1)
        for step in range(STEPS)
    ]


def fp8_sensitivity(data: list[list[torch.Tensor]]) -> None:
    """Largest |Δ| / value after step 1 of the FP8 reference's losses and gradient norms, weights perturbed."""
    seed = RunConfig().train.seed
    for recipe in ("tensorwise", "rowwise"):
        for name, cfg in (("dense", CFG), ("moe", MOE_CFG)):
            cfg = dataclasses.replace(cfg, fp8=recipe)
            clean = train(cfg, seed, 0.0, data)
            worst = [0.0, 0.0]
            for eps in FP8_PERTURBATIONS:
                for i, (got, want) in enumerate(zip(train(cfg, seed, eps, data), clean)):
                    ratios = [abs(a - b) / b for a, b in zip(got, want)]
                    worst[i] = max(worst[i], *ratios[1:])
            print(
                f"fp8 {recipe} {name}, tests' batches, weights × (1 + eps·N(0,1)), eps 1e-7 to 3e-7: largest "
                f"after step 1: loss {worst[0]:.1e}, grad norm {worst[1]:.1e}"
            )


def main() -> None:
    if sys.argv[1:] == ["fp8"]:
        with tempfile.TemporaryDirectory() as cache_dir:
            fp8_sensitivity(test_batches(Path(cache_dir)))
        return
    with tempfile.TemporaryDirectory() as cache_dir:
        datasets = {
            "random tokens": random_batches(),
            "tests' batches": test_batches(Path(cache_dir)),
        }
    for data_name, data in datasets.items():
        for name, cfg in (("dense", CFG), ("moe", MOE_CFG)):
            worst = 0.0
            for seed in (RunConfig().train.seed, 0, 1, 2):  # the first is the tests' model seed
                clean = grad_norms(cfg, seed, 0.0, data)
                for eps in PERTURBATIONS:
                    ratios = [
                        abs(a - b) / b for a, b in zip(grad_norms(cfg, seed, eps, data), clean)
                    ]
                    worst = max(worst, *ratios[1:])
                    print(
                        f"{data_name} {name} seed {seed} eps {eps:.0e}: |Δ grad norm| / grad norm per step: "
                        + " ".join(f"{r:.1e}" for r in ratios)
                    )
            print(f"{data_name} {name}: largest after step 1: {worst:.1e}")
    data, seed = datasets["tests' batches"], RunConfig().train.seed
    clean = train(CFG, seed, 0.0, data)
    for fmt, u in UNIT_ROUNDOFF.items():
        moved = train(CFG, seed, u, data)
        for what, got, want in zip(("loss", "grad norm"), moved, clean):
            ratios = [abs(a - b) / b for a, b in zip(got, want)]
            print(
                f"format unit roundoff: tests' batches dense, weights scaled by 1 + u·N(0,1), u = {fmt}'s {u:.2e}: "
                f"|Δ {what}| / {what} per step: "
                + " ".join(f"{r:.1e}" for r in ratios)
                + f"; in units of u: step 1 {ratios[0] / u:.2g}, largest {max(ratios) / u:.2g}"
            )
    fp8_sensitivity(data)


if __name__ == "__main__":
    main()
