"""The fused loss's head weight gradient: Gᵀ X over chunks, a group of chunks' rows of G per
GEMM (as many as fit in the fp32 sum's bytes), equal to the whole product; one group gives the
product itself, several an fp32 sum; and how many rows a group holds."""

from __future__ import annotations

import pytest
import torch

from titanlab.components.head_gradient import RowGradients, group_rows


def test_a_group_holds_the_rows_that_fit_in_the_fp32_sums_bytes():
    # Llama 3 8B's head (dim 4096) in bf16: 8192 rows, so one 8k sequence is one GEMM
    assert group_rows(4096, 256, torch.bfloat16, 10**6) == 8192
    assert group_rows(4096, 256, torch.bfloat16, 8192) == 8192
    assert group_rows(4096, 256, torch.float32, 10**6) == 4096
    assert group_rows(4096, 3000, torch.bfloat16, 10**6) == 6000  # whole chunks
    assert group_rows(16, 256, torch.float32, 10**6) == 256  # at least one chunk
    assert group_rows(4096, 256, torch.bfloat16, 300) == 300  # at most the tokens


@pytest.mark.parametrize("tokens,chunk,dim", [(100, 16, 8), (100, 16, 64), (64, 16, 16)])
def test_grouped_products_equal_the_whole_product(tokens, chunk, dim, monkeypatch):
    import titanlab.components.head_gradient as head_gradient

    gen = torch.Generator().manual_seed(0)
    vocab = 24
    g = torch.randn(tokens, vocab, generator=gen)
    x, u = torch.randn(tokens, dim, generator=gen), torch.randn(tokens, 3, generator=gen)
    gemms = []
    product = head_gradient.product
    monkeypatch.setattr(head_gradient, "product", lambda *a: gemms.append(1) or product(*a))
    summed = RowGradients([x, u], vocab, chunk, torch.float32)
    for start in range(0, tokens, chunk):
        rows = summed.keep(g[start : start + chunk])
        assert torch.equal(rows, g[start : start + chunk])
        summed.flush(start + rows.shape[0])
    assert len(gemms) == 2 * -(-tokens // summed.rows)  # one GEMM per group and X
    grad_w, grad_b = summed.results()
    torch.testing.assert_close(grad_w, g.t() @ x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_b, g.t() @ u, rtol=1e-5, atol=1e-5)


def test_no_tokens_give_zeros():
    summed = RowGradients([torch.empty(0, 8)], 24, 16, torch.float32)
    (grad_w,) = summed.results()
    assert grad_w.shape == (24, 8) and not grad_w.any()
