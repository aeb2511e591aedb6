"""The zero-centered RMSNorm (`common/norms.py`) equals Hugging Face's `Qwen3_5RMSNorm` (weight
stored as the offset from one) in fp32 and bf16, and `nn.RMSNorm` with weight 1 + w."""

from __future__ import annotations

import pytest
import torch

from titanlab.models.common.norms import ZeroCenteredRMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_transformers_and_rmsnorm_with_one_plus_w(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    torch.manual_seed(0)
    theirs, ours = Qwen3_5RMSNorm(48, eps=1e-6), ZeroCenteredRMSNorm(48, eps=1e-6)
    w = torch.randn(48) * 0.3
    theirs.weight.data, ours.weight.data = w.clone(), w.clone()
    x = (torch.randn(3, 7, 48) * 4).to(dtype)
    torch.testing.assert_close(ours(x), theirs(x), atol=0, rtol=0)
    plain = torch.nn.RMSNorm(48, eps=1e-6)
    plain.weight.data = 1 + w
    torch.testing.assert_close(ours(x.float()), plain(x.float()), atol=1e-6, rtol=1e-6)
    ours.reset_parameters()
    assert torch.equal(ours.weight, torch.zeros(48))
