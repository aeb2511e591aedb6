"""The titanlab ⇄ Hugging Face state-dict adapter on Llama: name map, RoPE permutation, tied
embeddings (Qwen3's q/k norms: tests/unit/models/qwen3)."""

import dataclasses
import os

import pytest
import torch

from titanlab.models.common.hf_adapter import (
    HFStateDictAdapter,
    from_hf_name,
    permute_from_hf,
    permute_to_hf,
    to_hf_name,
)
from titanlab.models.llama3 import Transformer, llama3_flavors
from titanlab.models.common.rope import apply_rotary_emb, precompute_rope_cos_sin

TINY = dataclasses.replace(
    llama3_flavors["debugmodel"],
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=50,
    max_seq_len=16,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers loads local folders only


@pytest.mark.parametrize("n_heads,head_dim,cols", [(1, 2, 3), (4, 8, 5), (8, 64, 16), (2, 6, 1)])
def test_permutation_round_trip(n_heads, head_dim, cols):
    w = torch.randn(n_heads * head_dim, cols)
    hf = permute_to_hf(w, n_heads)
    assert hf.shape == w.shape and hf.is_contiguous()
    assert torch.equal(permute_from_hf(hf, n_heads), w)
    assert torch.equal(permute_to_hf(permute_from_hf(w, n_heads), n_heads), w)


def test_permutation_follows_the_rotate_half_layout():
    """HF row s * head_dim/2 + i of each head holds titanlab row 2i + s."""
    n_heads, head_dim = 3, 8
    w = torch.arange(n_heads * head_dim, dtype=torch.float32)[:, None].expand(-1, 2).contiguous()
    hf = permute_to_hf(w, n_heads)
    for h in range(n_heads):
        for s in range(2):
            for i in range(head_dim // 2):
                assert hf[h * head_dim + s * head_dim // 2 + i, 0] == h * head_dim + 2 * i + s


def _hf_rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RoPE: x * cos + rotate_half(x) * sin with cos/sin repeated over halves.
    x: (bs, seq, heads, head_dim); cos/sin: (seq, head_dim // 2)."""
    cos = torch.cat((cos, cos), dim=-1)[None, :, None, :]
    sin = torch.cat((sin, sin), dim=-1)[None, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def test_permuted_projections_give_the_same_attention_scores():
    """q·k after RoPE is the same in both layouts once wq/wk are permuted (wv/wo untouched)."""
    torch.manual_seed(0)
    n_heads, n_kv, head_dim, dim, seq = 4, 2, 16, 32, 12
    wq, wk = torch.randn(n_heads * head_dim, dim), torch.randn(n_kv * head_dim, dim)
    x = torch.randn(2, seq, dim)
    cos, sin = precompute_rope_cos_sin(head_dim, seq, 500000.0, llama3_flavors["8B"].rope_scaling)
    q, k = apply_rotary_emb(
        (x @ wq.T).view(2, seq, n_heads, head_dim),
        (x @ wk.T).view(2, seq, n_kv, head_dim),
        cos,
        sin,
    )
    q_hf = _hf_rotate_half_rope(
        (x @ permute_to_hf(wq, n_heads).T).view(2, seq, n_heads, head_dim), cos, sin
    )
    k_hf = _hf_rotate_half_rope(
        (x @ permute_to_hf(wk, n_kv).T).view(2, seq, n_kv, head_dim), cos, sin
    )
    rep = n_heads // n_kv
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(rep, dim=2))
    scores_hf = torch.einsum("bqhd,bkhd->bhqk", q_hf, k_hf.repeat_interleave(rep, dim=2))
    torch.testing.assert_close(scores_hf, scores, rtol=1e-5, atol=1e-4)
    # Without the permutation the layouts disagree: the test would catch a missing permute.
    k_raw = _hf_rotate_half_rope((x @ wk.T).view(2, seq, n_kv, head_dim), cos, sin)
    q_raw = _hf_rotate_half_rope((x @ wq.T).view(2, seq, n_heads, head_dim), cos, sin)
    wrong = torch.einsum("bqhd,bkhd->bhqk", q_raw, k_raw.repeat_interleave(rep, dim=2))
    assert (wrong - scores).abs().max() > 1e-2


def test_name_map_round_trips_every_weight():
    model = Transformer(TINY)
    names = list(model.state_dict())
    hf_names = [to_hf_name(n) for n in names]
    assert len(set(hf_names)) == len(names)
    assert [from_hf_name(h) for h in hf_names] == names
    assert to_hf_name("layers.1.feed_forward.w2.weight") == "model.layers.1.mlp.down_proj.weight"
    assert (
        to_hf_name("layers.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    assert to_hf_name("output.weight") == "lm_head.weight"


@pytest.mark.parametrize(
    "bad", ["layers.0.attention.wq.lora_A", "rope_cos", "layers.x.ffn_norm.weight"]
)
def test_unknown_names_are_one_line_errors(bad):
    with pytest.raises(ValueError, match="valid:") as e:
        to_hf_name(bad)
    assert "\n" not in str(e.value) and repr(bad) in str(e.value)
    with pytest.raises(ValueError, match="is not a Hugging Face weight name titanlab knows"):
        from_hf_name("model.layers.0.self_attn.rotary_emb.inv_freq")


@pytest.mark.parametrize("tied", [False, True])
def test_state_dict_round_trip_and_hf_names(tied):
    args = dataclasses.replace(TINY, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    adapter = HFStateDictAdapter(args)
    sd = model.state_dict()
    hf = adapter.to_hf_state_dict(sd)
    assert ("lm_head.weight" in hf) is not tied
    back = adapter.from_hf_state_dict(hf)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    if tied:
        assert back["output.weight"] is back["tok_embeddings.weight"]

    transformers = pytest.importorskip("transformers")
    from titanlab.models.llama3.hf import to_config

    config = transformers.LlamaConfig(**to_config(args, torch.float32, 4096, None, None))
    hf_model = transformers.LlamaForCausalLM(config)
    want = set(hf_model.state_dict()) - ({"lm_head.weight"} if tied else set())
    assert set(hf) == want
    assert all(hf[k].shape == hf_model.state_dict()[k].shape for k in hf)
