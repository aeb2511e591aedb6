"""float8 rowwise grouped experts against bf16 on a GPU with float8 (torchao's Triton kernels and
`torch._scaled_grouped_mm`, which the CPU has not): the outputs and gradients within float8's
rounding. Skips without such a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from titanlab.config.job_config import Float8
from titanlab.models.common.experts import GroupedExperts
from titanlab.precision.float8_experts import apply_float8_experts

pytest.importorskip("torchao")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with float8 (compute capability >= 8.9)",
)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_float8_grouped_experts_equal_bf16_within_float8s_rounding():
    """8 experts (dim 512, width 256), 4,096 slots routed unevenly (some groups not multiples
    of 16, one empty): e4m3 keeps 3 mantissa bits, so a product is off by up to 2^-4 and a
    GEMM's output by a few percent of its norm; 8% is allowed for outputs and gradients."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    bf16 = GroupedExperts(dim=512, hidden_dim=256, num_experts=8).to(device, torch.bfloat16)
    bf16.init_weights(0.02)
    fp8 = copy.deepcopy(bf16)
    assert apply_float8_experts(fp8, Float8(enable=True, grouped_experts=True), device) == 1
    counts = torch.tensor([700, 513, 0, 1000, 333, 550, 600, 400], device=device)
    x = torch.randn(int(counts.sum()), 512, device=device, dtype=torch.bfloat16)
    grad = torch.randn(x.shape[0], 512, device=device, dtype=torch.bfloat16)
    results = []
    for module in (bf16, fp8):
        xi = x.clone().requires_grad_()
        out = module(xi, counts)
        out.backward(grad)
        results.append((out, xi.grad, module.w1.grad, module.w2.grad))
    for name, want, got in zip(("output", "x grad", "w1 grad", "w2 grad"), *results):
        err = relative_error(got, want)
        print(f"{name}: relative error {err:.4f}")
        assert err < 0.08, name
