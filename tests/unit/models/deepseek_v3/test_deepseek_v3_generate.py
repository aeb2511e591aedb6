"""DeepSeek-V3 generation: the multi-head latent attention cache (compressed latent + rotary key)
decodes exactly as recomputing the sequence, greedy output equals transformers' `generate` with
left padding, and the cache's size against a full K/V cache at the 671B shape."""

import dataclasses
import json
import os
import sys

import pytest
import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "generation")
)
from test_generate import assert_cached_decode_is_recomputation, hf_greedy

from titanlab.generation import generate
from titanlab.models.common.hf_adapter import HFStateDictAdapter
from titanlab.models.common.rope import YarnScaling
from titanlab.models.deepseek_v3 import deepseek_v3_flavors
from titanlab.models.deepseek_v3.hf import to_config
from titanlab.models.registry import build_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = dataclasses.replace(
    deepseek_v3_flavors["debugmodel"], dim=64, n_layers=3, n_heads=4, q_lora_rank=24,
    kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, hidden_dim=96,
    vocab_size=97, max_seq_len=64,
    moe=dataclasses.replace(deepseek_v3_flavors["debugmodel"].moe, hidden_dim=32),
)  # fmt: skip
PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 8, 30], [1], [12, 13, 14, 15, 16]]
# The switches of the architecture, as in test_deepseek_v3_hf.py's shapes.
SHAPES = {
    "q_lora, 1 dense, 2 groups, mtp": TINY,
    "no q_lora, 0 dense, 4 groups of 2, yarn": dataclasses.replace(
        TINY, q_lora_rank=0, n_dense_layers=0, mtp_layers=0,
        moe=dataclasses.replace(TINY.moe, n_groups=4, topk_groups=2),
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16,
                                 mscale=1.0, mscale_all_dim=1.0),
    ),
    "q_lora, 2 dense, 1 group, 2 shared": dataclasses.replace(
        TINY, n_layers=4, n_dense_layers=2, mtp_layers=0,
        moe=dataclasses.replace(TINY.moe, n_groups=1, topk_groups=1, num_shared_experts=2),
    ),
}  # fmt: skip


def tiny_model(seed: int = 3, args=TINY):
    torch.manual_seed(seed)
    model = build_model(args)
    model.init_weights()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.normal_(0.0, 0.1)  # the bias routes: imported and cached alike
    return model.eval()


def test_cached_decode_equals_recomputing_the_whole_sequence():
    model = tiny_model()
    assert_cached_decode_is_recomputation(model, PROMPTS, 10)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_equals_transformers_generate(shape, tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    args = SHAPES[shape]
    model = tiny_model(args=args)
    # Through a saved folder: transformers fuses the per-expert tensors of the files on load.
    (tmp_path / "config.json").write_text(
        json.dumps(to_config(args, torch.float32, 64, None, None))
    )
    state = HFStateDictAdapter(args).to_hf_state_dict(model.state_dict())
    save_file({k: v.clone() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path)).eval()
    moe = str(args.n_dense_layers)  # the first MoE block
    bias = hf.model.layers[int(moe)].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, model.layers[moe].feed_forward.expert_bias) and bias.abs().sum() > 0
    assert generate(model, PROMPTS, 24) == hf_greedy(hf, PROMPTS, 24)


def test_the_671b_latent_cache_is_71x_smaller_than_a_full_kv_cache():
    """Per token, bf16: each layer caches kv_lora_rank + qk_rope_head_dim values (the cache
    tensors `MLAttention` hands `KVCache`, checked on the tiny model), against the expanded
    keys (n_heads × qk_head_dim) and values (n_heads × v_head_dim) a GQA-style cache would hold
    (DeepSeek-V2, arXiv:2405.04434, §2.1.2)."""
    model = tiny_model()
    from titanlab.models.common.kv_cache import KVCache

    cache = KVCache(torch.zeros(1, dtype=torch.long), max_seq_len=8)
    cache.begin(4)
    with torch.no_grad():
        model.layers["0"].attention(
            torch.randn(1, 4, TINY.dim), model.rope_cos[:4][None], model.rope_sin[:4][None],
            cache.layer(0),
        )  # fmt: skip
    assert cache._k[0].shape[2:] == (1, TINY.kv_lora_rank)
    assert cache._v[0].shape[2:] == (1, TINY.qk_rope_head_dim)

    big = deepseek_v3_flavors["671B"]
    latent = big.n_layers * (big.kv_lora_rank + big.qk_rope_head_dim) * 2
    full = big.n_layers * big.n_heads * (big.qk_head_dim + big.v_head_dim) * 2
    ratio = full / latent
    print(f"671B KV cache per token: MLA {latent:,} B, full K/V {full:,} B ({ratio:.1f}x); "
          f"one 131,072-token sequence: {latent * 131072 / 2**30:.2f} GiB against "
          f"{full * 131072 / 2**30:.0f} GiB")  # fmt: skip
    assert (latent, full) == (70_272, 4_997_120)
    assert 71 < ratio < 71.2
