"""On a CUDA target the ledger records SDPA as the kernel CUDA picks (cuDNN on Hopper,
FlashAttention-2 before, the memory-efficient kernel for masks and unequal head dims, the math
fallback for inputs that are not 4-D), with its FLOPs and without a score matrix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from titanlab.config.device_path import Target
from titanlab.ledger.gpu_kernels import gpu_attention, sdpa_kernel
from titanlab.ledger.record import Recorder

H100, A100 = Target("cuda", (9, 0)), Target("cuda", (8, 0))


def test_the_kernel_cuda_takes():
    q, v = torch.empty(1, 2, 8, 128, device="meta"), torch.empty(1, 2, 8, 64, device="meta")
    assert sdpa_kernel(H100, q, q, masked=False) == "cudnn"
    assert sdpa_kernel(A100, q, q, masked=False) == "flash"
    assert sdpa_kernel(H100, q, q, masked=True) == "efficient"
    assert sdpa_kernel(H100, q, v, masked=False) == "efficient"  # MLA's 192 / 128


@pytest.mark.parametrize(
    "target,qk_dim,masked,want",
    [(H100, 64, False, "cudnn"), (A100, 64, False, "flash"), (H100, 96, False, "efficient"),
     (H100, 64, True, "efficient")],
)  # fmt: skip
def test_recorded_as_one_fused_kernel_forward_and_backward(target, qk_dim, masked, want):
    b, h, s = 1, 2, 256
    with FakeTensorMode():
        q = torch.empty(b, h, s, qk_dim, requires_grad=True)
        k = torch.empty(b, h, s, qk_dim, requires_grad=True)
        v = torch.empty(b, h, s, 64, requires_grad=True)
        mask = torch.ones(s, s, dtype=torch.bool).tril() if masked else None
        rec = Recorder()
        with gpu_attention(target), rec:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked)
            out.sum().backward()
    assert out.shape == (b, h, s, 64)
    ran = [op.op for op in rec.ops if op.kind == "attention"]
    assert ran == [f"aten._scaled_dot_product_{want}_attention.default",
                   f"aten._scaled_dot_product_{want}_attention_backward.default"]  # fmt: skip
    assert not any(op.kind == "gemm" for op in rec.ops)  # no bmm of a score matrix
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_inputs_that_are_not_four_d_take_the_math_fallback():
    with FakeTensorMode():
        q = torch.empty(1, 2, 3, 16, 8)
        rec = Recorder()
        with gpu_attention(H100), rec:
            F.scaled_dot_product_attention(q, q, q)
    assert any(op.op == "aten.bmm.default" for op in rec.ops)
