"""On a CUDA GPU, document masking runs through FlexAttention's block mask (compiled), and its
forward and backward equal SDPA with the dense boolean mask (skipped without CUDA; the CPU tests
in test_document_mask.py check the same mask against documents run alone)."""

import pytest
import torch

from titanlab.models.common.attention import Attention
from titanlab.data.segments import document_ids
from titanlab.models.common.document_mask import attention_masks, block_causal_mask
from titanlab.models.common.rope import precompute_rope_cos_sin

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_flex_block_mask_forward_and_backward_equal_the_dense_mask():
    torch.manual_seed(0)
    attn = Attention(256, 8, 4, 32, None).cuda()
    attn.init_weights(0.02)
    cos, sin = precompute_rope_cos_sin(32, 512, 10000.0, None, device="cuda")
    tokens = torch.randint(1, 50, (2, 512), device="cuda")
    tokens[:, ::97] = 0  # EOS every 97 tokens
    seg = document_ids(tokens, 0)
    x = torch.randn(2, 512, 256, device="cuda", requires_grad=True)
    block = attention_masks(seg, None, [None], False, 512, seg.device)[None]
    flex = attn(x, cos, sin, mask=block)
    (gx_flex,) = torch.autograd.grad(flex.square().sum(), x)
    dense = attn(x, cos, sin, mask=block_causal_mask(seg))
    (gx_dense,) = torch.autograd.grad(dense.square().sum(), x)
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(gx_flex, gx_dense, atol=2e-4, rtol=1e-3)
