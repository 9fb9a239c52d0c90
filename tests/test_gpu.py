"""What only a GPU can show, on one GPU (`gpu` marker: skipped where torch sees no CUDA; device_check.sh runs it).

The CPU suite proves every layout against one process; these check that the CUDA paths compute the same numbers
as the CPU reference, and that the channel rule refuses exactly the mixed-device collective NCCL would hang on.
"""

from __future__ import annotations

import pytest
import torch

from keel.config import ModelConfig
from keel.model import CausalLM
from keel.parallel import comm

pytestmark = pytest.mark.gpu

CFG = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)


def test_model_on_cuda_matches_cpu_in_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tokens = torch.randint(0, CFG.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    losses, grads = {}, {}
    for device in ("cpu", "cuda"):
        model = CausalLM(CFG, seed=0).to(device)
        t = tokens.to(device)
        loss = model(t[:, :-1], t[:, 1:])
        loss.backward()
        losses[device] = loss.item()
        grads[device] = torch.cat([p.grad.flatten().cpu() for p in model.parameters()])
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-5)
    torch.testing.assert_close(grads["cuda"], grads["cpu"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("documents", [False, True])
def test_ring_attention_blocks_on_cuda_equal_sdpa(documents):
    """Context parallel's blocks on CUDA (the plain-PyTorch path) against CUDA's SDPA, forward and gradients."""
    from tests.test_context_parallel import check_ring_of_one

    torch.backends.cuda.matmul.allow_tf32 = False
    check_ring_of_one("cuda", documents)


def test_channels_refuse_the_mixed_device_collective():
    device = comm.Group("world", (0, 1), 0, comm.DEVICE, device_type="cuda")
    control = comm.Group("world", (0, 1), 0, comm.CONTROL, device_type="cuda")
    comm.check("all_reduce_sum", device, torch.zeros((), device="cuda"))
    with pytest.raises(RuntimeError, match="needs a cuda tensor"):
        comm.check("all_reduce_sum", device, torch.zeros(()))
    with pytest.raises(RuntimeError, match="needs a cpu tensor"):
        comm.check("all_reduce_max", control, torch.zeros((), device="cuda"))


def test_moe_grouped_gemm_on_cuda_matches_the_expert_loop_in_bf16():
    """The CUDA bf16 default (torch's grouped GEMM) against the per-expert loop, without a host sync of its own."""
    from keel.model.moe import MoE

    torch.manual_seed(0)
    layer = (
        MoE(
            ModelConfig(
                vocab_size=64,
                dim=64,
                n_layers=2,
                n_heads=4,
                n_kv_heads=2,
                moe_experts=8,
                moe_top_k=2,
            )
        )
        .cuda()
        .bfloat16()
    )
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16)
    results = []
    for grouped in (False, True):
        layer.zero_grad()
        layer.grouped_gemm = grouped
        out = layer(x)
        out.float().square().sum().backward()
        results.append([out.float()] + [p.grad.float() for p in layer.parameters()])
    for loop, fused in zip(*results):
        torch.testing.assert_close(fused, loop, rtol=2e-2, atol=2e-2)
