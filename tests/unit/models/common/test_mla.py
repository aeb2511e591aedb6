"""Multi-head latent attention against transformers' `DeepseekV3Attention`, and its cache.

Every (query compression, RoPE scaling) pair is generated; d_v ≠ d_nope so a wrong split of
`wkv_b`'s output shows, and the latent norms get random weights so a skipped norm shows.
"""

import itertools

import pytest
import torch

from titanlab.models.common.kv_cache import KVCache
from titanlab.models.common.mla import MLAttention
from titanlab.models.common.rope import (
    YarnScaling,
    precompute_rope_cos_sin,
    softmax_mscale,
)

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

DIM, HEADS, KV_LORA, NOPE, ROPE, V = 64, 4, 16, 16, 8, 12
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


def _pair(q_lora: int | None, yarn: bool):
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {**YARN, "rope_theta": 10000.0}
    config = transformers.DeepseekV3Config(
        hidden_size=DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        max_position_embeddings=64,
        rope_parameters=rope,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    theirs = hf_ds.DeepseekV3Attention(config, 0).double().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.normal_(1.0, 0.2) if "layernorm" in name else p.normal_(0.0, 0.1)
    scaling = (
        YarnScaling(factor=4.0, original_max_position_embeddings=16, mscale=0.707,
                    mscale_all_dim=0.707)
        if yarn
        else None
    )  # fmt: skip
    ours = MLAttention(
        DIM, HEADS, q_lora or 0, KV_LORA, NOPE, ROPE, V,
        (NOPE + ROPE) ** -0.5 * softmax_mscale(scaling),
    ).double()  # fmt: skip
    names = {
        "q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_a_norm", "q_b_proj": "wq_b",
        "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "wkv_b",
        "o_proj": "wo",
    }  # fmt: skip
    ours.load_state_dict(
        {f"{names[k.split('.')[0]]}.weight": v for k, v in theirs.state_dict().items()}
    )
    return config, theirs, ours, scaling


@pytest.mark.parametrize(("q_lora", "yarn"), list(itertools.product([None, 24], [False, True])))
def test_mla_equals_transformers(q_lora, yarn):
    config, theirs, ours, scaling = _pair(q_lora, yarn)
    assert (ours.wq is None) == (q_lora is not None)
    assert ours.softmax_scale == pytest.approx(theirs.scaling, rel=1e-12)
    x = torch.randn(2, 17, DIM, dtype=torch.float64)
    positions = torch.arange(17)[None].expand(2, -1)
    cos_hf, sin_hf = hf_ds.DeepseekV3RotaryEmbedding(config)(x, positions)
    with torch.no_grad():
        want = theirs(x, (cos_hf.double(), sin_hf.double()), attention_mask=None)[0]
        cos, sin = precompute_rope_cos_sin(ROPE, 32, 10000.0, scaling)
        got = ours(x, cos.double(), sin.double())
    assert got.shape == (2, 17, DIM)
    diff = (got - want).abs().max().item()
    print(f"q_lora={q_lora} yarn={yarn}: max |MLA - transformers| = {diff:.3g}")
    assert diff < 1e-6


def test_mla_cache_holds_the_latents_and_decodes_as_the_full_forward():
    """Prefill 5 tokens, decode 3 one by one: each equals the full forward's row; the cache
    holds kv_lora_rank + qk_rope_head_dim values per token, not the expanded keys/values."""
    _, _, ours, _ = _pair(24, False)
    x = torch.randn(2, 8, DIM, dtype=torch.float64)
    cos, sin = precompute_rope_cos_sin(ROPE, 32, 10000.0, None)
    cos, sin = cos.double(), sin.double()
    with torch.no_grad():
        full = ours(x, cos, sin)
        cache = KVCache(torch.zeros(2, dtype=torch.long), max_seq_len=8)
        outs = []
        for start, end in [(0, 5), (5, 6), (6, 7), (7, 8)]:
            positions = cache.begin(end - start)
            outs.append(ours(x[:, start:end], cos[positions], sin[positions], cache.layer(0)))
            cache.end()
    diff = (torch.cat(outs, 1) - full).abs().max().item()
    assert diff < 1e-10, diff
    k, v = cache._k[0], cache._v[0]
    assert k.shape == (2, 8, 1, KV_LORA) and v.shape == (2, 8, 1, ROPE)
    latent = KV_LORA + ROPE
    expanded = HEADS * (NOPE + ROPE + V)
    print(f"MLA cache per token and layer: {latent} values; expanded K/V: {expanded}")
    assert latent < expanded
