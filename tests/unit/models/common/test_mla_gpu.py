"""On a CUDA GPU, multi-head latent attention in bf16 (value heads narrower than query/key heads,
its own softmax scale) runs a fused SDPA kernel, not the math fallback, forward and backward, and
matches a float64 CPU reference (skipped without CUDA). Which kernel runs is printed: flash needs
equal head dims, so SDPA may pick its memory-efficient or cuDNN kernel here."""

import copy

import pytest
import torch

from titanlab.models.common.mla import MLAttention
from titanlab.models.common.rope import precompute_rope_cos_sin

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
FUSED = {
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_efficient_attention",
}


def test_bf16_mla_runs_a_fused_kernel_and_matches_float64():
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    # DeepSeek-V3's head widths (128 + 64 query/key, 128 value) on 8 heads.
    ref = MLAttention(1024, 8, 384, 512, 128, 64, 128, 192**-0.5).double()
    for name, p in ref.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.05)
    mla = copy.deepcopy(ref).to("cuda", torch.bfloat16)
    cos, sin = precompute_rope_cos_sin(64, 1024, 10000.0, None)
    x = torch.randn(2, 1024, 1024, dtype=torch.float64)
    expected = ref(x, cos.double(), sin.double())
    xc = x.to("cuda", torch.bfloat16).requires_grad_(True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = mla(xc, cos.cuda(), sin.cuda())
        out.float().square().mean().backward()
        torch.cuda.synchronize()
    ops = {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")}
    print(f"MLA bf16 SDPA operators: {sorted(ops)}")
    assert ops & FUSED, ops
    err = (out.double().cpu() - expected).abs().max().item() / expected.abs().max().item()
    assert err < 2e-2, err
