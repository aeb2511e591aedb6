"""The CUDA path of masked attention (FlexAttention with `flex_masks`' block masks, sinks through
its log-sum-exp: `common/flex_kernel.py`) against the CPU path (SDPA with dense masks, the
chunked sliding window, the sink as an extra key: `common/local_attention.py`), forward, within
1e-5 in fp32: GQA with windows (dividing the 128-token tile or not), sinks, both, each with and
without documents of generated lengths; MLA with documents.

FlexAttention has no CPU backward in torch 2.13 and its compiled CPU kernel returns no
log-sum-exp, so the sink cases run flex attention's eager form (the same semantics, the scores
materialized) and the others the compiled kernel; sequences are multiples of the CPU kernel's
32-token block (pytorch/pytorch#159247, `test_document_mask.py`) and not of the 128-token tile.
The GPU file (`test_flex_attention_gpu.py`) checks forward and backward on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from titanlab.models.common import flex_kernel
from titanlab.models.common.attention import Attention
from titanlab.models.common.document_mask import block_causal_mask
from titanlab.models.common.flex_masks import band_block_mask, document_block_mask
from titanlab.models.common.mla import MLAttention
from titanlab.models.common.rope import precompute_rope_cos_sin
from tests.unit.models.common.test_flex_masks import random_documents, restarted

SEQ = 320


@pytest.fixture
def eager_flex(monkeypatch):
    monkeypatch.setattr(flex_kernel, "compiled_flex_attention", lambda: flex_attention)


def gqa(window, sinks, seed=0) -> Attention:
    torch.manual_seed(seed)
    attn = Attention(64, 4, 2, 16, None, sinks=sinks, window=window)
    attn.init_weights(0.02)
    if sinks:  # sinks of either sign and size, so the gate matters
        attn.sinks.weight.data = torch.randn(4) * 2
    return attn


def both_paths(attn, x, cos, sin, segments, positions, window):
    """(flex path, SDPA path) outputs of `attn` on x (bs, SEQ, dim)."""
    if segments is None:
        block = band_block_mask(SEQ, SEQ, window, x.device)
        dense = None
    else:
        block = document_block_mask(segments, positions, segments, positions, window)
        dense = block_causal_mask(segments)
    with torch.no_grad():
        return attn(x, cos, sin, mask=block), attn(x, cos, sin, mask=dense)


def inputs(seed: int, dim: int, documents: bool, restart: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, SEQ, dim, generator=gen)
    if not documents:
        return x, None, None
    segments = random_documents(gen, 2, SEQ)
    positions = restarted(segments) if restart else torch.arange(SEQ).expand(2, SEQ)
    return x, segments, positions


def rope(head_dim: int, positions):
    cos, sin = precompute_rope_cos_sin(head_dim, SEQ, 10000.0, None)
    if positions is None:
        return cos, sin
    return cos[positions], sin[positions]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [None, 48, 100, 128])
def test_sinks_equal_the_sdpa_path(seed, window, eager_flex):
    documents = seed % 3 != 0
    x, segments, positions = inputs(seed, 64, documents, restart=seed % 2 == 1)
    attn = gqa(window, sinks=True, seed=seed)
    cos, sin = rope(16, positions)
    flex, sdpa = both_paths(attn, x, cos, sin, segments, positions, window)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=0)


@pytest.mark.parametrize("documents", [True, False])
def test_the_compiled_kernel_equals_the_sdpa_path_for_windows(documents):
    x, segments, positions = inputs(11, 64, documents, restart=True)
    attn = gqa(100, sinks=False)
    cos, sin = rope(16, positions)
    flex, sdpa = both_paths(attn, x, cos, sin, segments, positions, 100)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=0)


def test_the_compiled_kernel_equals_the_sdpa_path_for_mla_with_documents():
    """MLA's value head (8) differs from its query/key head (12 + 4)."""
    torch.manual_seed(0)
    mla = MLAttention(64, 4, 0, 32, 12, 4, 8, 16**-0.5)
    mla.init_weights(0.02)
    x, segments, positions = inputs(3, 64, True, restart=False)
    cos, sin = rope(4, positions)
    flex, sdpa = both_paths(mla, x, cos, sin, segments, positions, None)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=0)


def test_a_mutant_window_is_caught(eager_flex):
    """The check can fail: the block mask one token wider than the layer's window differs."""
    x, segments, positions = inputs(5, 64, True, restart=False)
    attn = gqa(48, sinks=True)
    cos, sin = rope(16, positions)
    with torch.no_grad():
        flex = attn(x, cos, sin, mask=document_block_mask(segments, positions, segments,
                                                           positions, 49))  # fmt: skip
        sdpa = attn(x, cos, sin, mask=block_causal_mask(segments))
    assert (flex - sdpa).abs().max() > 1e-4
