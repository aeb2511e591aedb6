"""The delta rule's kernel choice (`common/delta_rule_kernel.py`): PyTorch's chunked rule on CPU
and on the ledger's CPU tensors; flash-linear-attention's kernel only on real CUDA tensors, called
with the contract `delta_rule.chunked` keeps (checked here against a stand-in of fla's signature
that computes the rule itself); and, on a GPU with fla installed, fla against PyTorch's rule."""

from __future__ import annotations

import pytest
import torch

from titanlab.models.common import delta_rule, delta_rule_kernel
from titanlab.models.common.linear_attention import l2_normalized


def inputs(seed=0, bs=2, seq=100, hk=2, hv=4, dk=16, dv=8, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalized(torch.randn(bs, seq, hk, dk, generator=g)) * dk**-0.5
    k = l2_normalized(torch.randn(bs, seq, hk, dk, generator=g))
    v = torch.randn(bs, seq, hv, dv, generator=g)
    decay = -torch.rand(bs, seq, hv, generator=g)
    beta = torch.rand(bs, seq, hv, generator=g)
    state = torch.randn(bs, hv, dk, dv, generator=g)
    return [t.to(device) for t in (q, k, v, decay, beta, state)]


def fla_stand_in(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None):  # fmt: skip
    """fla's `chunk_gated_delta_rule` signature, computing the rule with PyTorch's."""
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalized(q), l2_normalized(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, final = delta_rule.chunked(q * scale, k, v, g, beta, initial_state)
    return out, (final if output_final_state else None)


def test_cpu_tensors_take_pytorchs_rule_even_with_fla_installed(monkeypatch):
    monkeypatch.setattr(delta_rule_kernel, "FLA_RULE", fla_stand_in)
    assert delta_rule_kernel.chunked_rule(torch.zeros(1)) is delta_rule.chunked


def test_the_fla_call_keeps_the_chunked_contract():
    q, k, v, g, beta, state = inputs()
    want, want_state = delta_rule.chunked(q, k, v, g, beta, state)
    got, got_state = delta_rule_kernel.fla_chunked(fla_stand_in, q, k, v, g, beta, state)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_state, want_state, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fla_equals_pytorchs_rule_on_the_gpu():
    if delta_rule_kernel.FLA_RULE is None:
        pytest.skip("flash-linear-attention is not installed")
    q, k, v, g, beta, state = inputs(seq=300, device="cuda")
    rule = delta_rule_kernel.chunked_rule(v)
    assert rule is not delta_rule.chunked
    got, got_state = rule(q, k, v, g, beta, state)
    want, want_state = delta_rule.chunked(q, k, v, g, beta, state)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_state, want_state, atol=2e-3, rtol=2e-3)
