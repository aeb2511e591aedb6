"""The fused loss on a CUDA GPU in bf16: the head's weight gradient is summed from bf16 GEMMs
(fp32 accumulation) instead of fp32 ones, and still equals the unfused head's gradient within
bf16 rounding; its GEMMs run in bf16 (no fp32 matmul kernel in the profiled backward).
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanlab.components.fused_ce import linear_cross_entropy_sum
from titanlab.components.loss import cross_entropy_sum

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_bf16_weight_gradient_equals_the_unfused_head_within_bf16_rounding():
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(2048, 512, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (0.05 * torch.randn(8192, 512, device="cuda", generator=g)).bfloat16()
    weight.requires_grad_()
    labels = torch.randint(0, 8192, (2048,), device="cuda", generator=g)
    want = cross_entropy_sum(F.linear(hidden.float(), weight.float()), labels)
    want_h, want_w = torch.autograd.grad(want, (hidden, weight))
    got = linear_cross_entropy_sum(hidden, weight, labels, chunk_size=256)
    got_h, got_w = torch.autograd.grad(got, (hidden, weight))
    assert abs(got.item() - want.item()) / 2048 < 1e-2
    for a, b in ((got_h, want_h), (got_w, want_w)):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 1e-2, rel


def test_no_fp32_gemm_in_the_bf16_fused_loss():
    hidden = torch.randn(1024, 256, device="cuda").bfloat16().requires_grad_()
    weight = torch.randn(4096, 256, device="cuda").bfloat16().requires_grad_()
    labels = torch.randint(0, 4096, (1024,), device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        linear_cross_entropy_sum(hidden, weight, labels, chunk_size=256).backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "gemm" in e.name.lower() or "nvjet" in e.name]
    assert names, "no GEMM kernel seen"
    fp32 = [n for n in names if "sgemm" in n.lower() or "f32f32" in n.lower()]
    assert not fp32, fp32
