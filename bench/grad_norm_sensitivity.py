"""How far fp32 rounding-sized weight differences move later gradient norms in the tests' tiny setup.

The equivalence tests compare per-step gradient norms of parallel runs with the single-process run. A parallel
run reduces in another order, so its weights differ from the reference's by fp32 rounding after the first update.
This measures the reference's own sensitivity to that: initial weights perturbed by 1e-7 relative, same data,
torch AdamW with the tests' settings (tests/keel_runs.py TINY), one process. Its largest per-step ratio bounds the
tolerance the tests may ask of steps after the first (tests/test_train_equivalence.py).

    python bench/grad_norm_sensitivity.py
"""

from __future__ import annotations

import dataclasses

import torch

from keel.config import ModelConfig
from keel.model.llama import CausalLM, weight_decay_groups

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, tie_embeddings=True)
MOE_CFG = dataclasses.replace(CFG, moe_experts=4)  # tests/test_moe_training.py MOE
STEPS, LR, WARMUP = 10, 0.01, 2


def grad_norms(cfg: ModelConfig, seed: int, perturbation: float, data: torch.Tensor) -> list[float]:
    model = CausalLM(cfg, seed=seed)
    if perturbation:
        noise = torch.Generator().manual_seed(123)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1 + perturbation * torch.randn(param.shape, generator=noise))
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=LR, betas=(0.9, 0.95), eps=1e-8)
    norms = []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = LR * min(1.0, (step + 1) / WARMUP)
        optimizer.zero_grad()
        model(data[step, :, :-1], labels=data[step, :, 1:]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
    return norms


def main() -> None:
    data = torch.randint(0, CFG.vocab_size, (STEPS, 8, 33), generator=torch.Generator().manual_seed(1))
    for name, cfg in (("dense", CFG), ("moe", MOE_CFG)):
        worst = 0.0
        for seed in range(4):
            clean, perturbed = grad_norms(cfg, seed, 0.0, data), grad_norms(cfg, seed, 1e-7, data)
            ratios = [abs(a - b) / b for a, b in zip(perturbed, clean)]
            worst = max(worst, *ratios[1:])
            print(f"{name} seed {seed}: |Δ grad norm| / grad norm per step: " + " ".join(f"{r:.1e}" for r in ratios))
        print(f"{name}: largest after step 1: {worst:.1e}")


if __name__ == "__main__":
    main()
