"""Qwen3.5's gated full attention through `Attention` (an output gate from wq, RoPE on a quarter
of each head, zero-centered q/k norms) against Hugging Face's `Qwen3_5Attention` on random
weights, fp32 within 1e-5: GQA with 4 query and 2 key-value heads, heads of 32 and 64, the rotary
part in Hugging Face's rotate-half layout permuted to titanlab's interleaved pairs."""

from __future__ import annotations

import pytest
import torch

from titanlab.models.common.attention import Attention
from titanlab.models.common.hf_adapter import permute_from_hf
from titanlab.models.common.norms import ZeroCenteredRMSNorm
from titanlab.models.common.rope import precompute_rope_cos_sin


def _rotary_rows_from_hf(w: torch.Tensor, heads: int, head_dim: int, rotary: int, width: int):
    """Rows of a (heads · width, ·) weight whose first `rotary` rows of each head's first
    head_dim are in rotate-half layout, permuted to interleaved pairs (the rest kept)."""
    w = w.view(heads, width, -1).clone()
    w[:, :rotary] = permute_from_hf(w[:, :rotary].reshape(heads * rotary, -1), heads).view(
        heads, rotary, -1
    )
    return w.reshape(heads * width, -1)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_gated_attention_equals_transformers(head_dim):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5Attention,
        Qwen3_5TextRotaryEmbedding,
    )

    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=head_dim, num_hidden_layers=1, vocab_size=32,
                               layer_types=["full_attention"])  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = Qwen3_5Attention(config, 0).float().eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.2)
    rotary = int(head_dim * config.rope_parameters["partial_rotary_factor"])
    ours = Attention(64, 4, 2, head_dim, config.rms_norm_eps, output_gate=True,
                     rotary_dim=rotary, norm_class=ZeroCenteredRMSNorm)  # fmt: skip
    sd = theirs.state_dict()
    q_norm, k_norm = sd["q_norm.weight"].clone(), sd["k_norm.weight"].clone()
    q_norm[:rotary] = permute_from_hf(q_norm[:rotary, None], 1)[:, 0]
    k_norm[:rotary] = permute_from_hf(k_norm[:rotary, None], 1)[:, 0]
    ours.load_state_dict({
        "wq.weight": _rotary_rows_from_hf(sd["q_proj.weight"], 4, head_dim, rotary, 2 * head_dim),
        "wk.weight": _rotary_rows_from_hf(sd["k_proj.weight"], 2, head_dim, rotary, head_dim),
        "wv.weight": sd["v_proj.weight"], "wo.weight": sd["o_proj.weight"],
        "q_norm.weight": q_norm, "k_norm.weight": k_norm,
    })  # fmt: skip
    seq = 40
    x = torch.randn(2, seq, 64)
    positions = torch.arange(seq).expand(2, seq)
    cos_hf, sin_hf = Qwen3_5TextRotaryEmbedding(config)(x, positions)
    causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    cos, sin = precompute_rope_cos_sin(rotary, seq, config.rope_parameters["rope_theta"], None)
    with torch.no_grad():
        want, _ = theirs(x, (cos_hf, sin_hf), causal)
        got = ours(x, cos, sin)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
