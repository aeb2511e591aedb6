"""Attention sinks and sliding windows (`common/local_attention.py`) against the textbook form:
scores, a mask, the sink logit as one more softmax column dropped after the softmax (Hugging
Face's gpt-oss eager attention). Outputs and gradients (q, k, v, sinks) within 1e-12 in fp64,
for windows shorter and longer than the sequence, lengths that do and do not divide into
windows, with and without a document mask."""

import pytest
import torch

from titanlab.models.common.local_attention import band_mask, sliding_window_attention


def reference(q, k, v, window, sinks, allowed):
    seq, d = q.shape[2], q.shape[-1]
    scores = q @ k.transpose(-1, -2) * d**-0.5
    mask = band_mask(seq, seq, window, q.device)
    if allowed is not None:
        mask = mask & allowed
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.view(1, -1, 1, 1).expand(scores.shape[0], -1, seq, 1)
        scores = torch.cat([scores, column], dim=-1)
    p = scores.softmax(-1)
    return (p[..., :-1] if sinks is not None else p) @ v


@pytest.mark.parametrize("seq, window", [(16, 4), (17, 5), (8, 16), (30, 3), (9, 4)])
@pytest.mark.parametrize("sinks", [True, False])
@pytest.mark.parametrize("documents", [True, False])
def test_equals_the_textbook_attention_with_gradients(seq, window, sinks, documents):
    gen = torch.Generator().manual_seed(seq * 100 + window)
    q, k, v = (torch.randn(2, 3, seq, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    s = torch.randn(3, dtype=torch.float64, generator=gen) * 2 if sinks else None
    allowed = None
    if documents:
        segments = torch.randint(0, 3, (2, seq), generator=gen).sort(-1).values
        allowed = (segments[:, :, None] == segments[:, None, :])[:, None]
    inputs = [t.requires_grad_() for t in (q, k, v, *([s] if sinks else []))]
    ours = sliding_window_attention(q, k, v, window, s, allowed)
    theirs = reference(q, k, v, window, s, allowed)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)
    g_ours = torch.autograd.grad(ours.square().sum(), inputs)
    g_theirs = torch.autograd.grad(theirs.square().sum(), inputs)
    for a, b in zip(g_ours, g_theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_a_zero_sink_with_no_key_left_gives_half_weight_to_nothing():
    """The sink takes its share of the softmax: one visible key of score 0 and a sink of 0 give
    that key's value weight 1/2."""
    q = torch.zeros(1, 1, 1, 4, dtype=torch.float64)
    v = torch.ones(1, 1, 1, 4, dtype=torch.float64)
    out = sliding_window_attention(q, q.clone(), v, 1, torch.zeros(1, dtype=torch.float64))
    torch.testing.assert_close(out, 0.5 * v)
