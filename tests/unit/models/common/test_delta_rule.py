"""The gated delta rule (`common/delta_rule.py`): in chunks (of 64, 16 and 7 tokens, the
sequence not a multiple of them) equal to token by token from a random starting state, output
and final state within 1e-5; and the final state affine in the starting one
(`sequence_transition`, what context parallel hands from rank to rank)."""

from __future__ import annotations

import pytest
import torch

from titanlab.models.common import delta_rule


@pytest.mark.parametrize("chunk", [64, 16, 7])
def test_chunks_equal_the_recurrence_and_carry_the_state(chunk):
    gen = torch.Generator().manual_seed(chunk)
    q, k = (torch.nn.functional.normalize(torch.randn(2, 100, 2, 8, generator=gen), dim=-1)
            for _ in range(2))  # fmt: skip
    v = torch.randn(2, 100, 4, 6, generator=gen)
    g = -torch.rand(2, 100, 4, generator=gen) * 3
    beta = torch.rand(2, 100, 4, generator=gen)
    start = torch.randn(2, 4, 8, 6, generator=gen)
    want, want_state = delta_rule.recurrent(q, k, v, g, beta, start)
    got, state = delta_rule.chunked(q, k, v, g, beta, start, chunk=chunk)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)
    t, b = delta_rule.sequence_transition(
        k, v, g, beta, chunk=chunk
    )  # the state is affine in the start
    torch.testing.assert_close(t @ start + b, want_state, atol=1e-5, rtol=1e-5)
