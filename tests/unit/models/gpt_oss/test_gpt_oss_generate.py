"""gpt-oss generation: the sliding layers' ring-buffer cache (the last W slots only) decodes
exactly as recomputing the sequence, greedy output equals transformers' `generate` with left
padding on shapes whose window is shorter and longer than the text, and the cache's size
against a full cache."""

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
from titanlab.models.common.kv_cache import KVCache
from titanlab.models.gpt_oss import gpt_oss_flavors
from titanlab.models.gpt_oss.hf import to_config
from titanlab.models.registry import build_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = dataclasses.replace(
    gpt_oss_flavors["debugmodel_deep"], n_layers=4, vocab_size=97, max_seq_len=64,
    sliding_window=4,
)  # fmt: skip
PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 8, 30], [1], [12, 13, 14, 15, 16]]
SHAPES = {
    "window 4 (wraps)": TINY,
    "window 64 (longer than the text)": dataclasses.replace(TINY, sliding_window=64),
    "window 3, three sliding layers": dataclasses.replace(
        TINY, sliding_window=3,
        layer_types=("sliding_attention",) * 3 + ("full_attention",),
    ),
}  # fmt: skip


def tiny_model(args=TINY, seed: int = 3):
    torch.manual_seed(seed)
    model = build_model(args)
    model.init_weights()
    with torch.no_grad():  # biases and sinks away from their zero / small init
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks.weight")):
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_cached_decode_equals_recomputing_the_whole_sequence(shape):
    model = tiny_model(SHAPES[shape])
    assert_cached_decode_is_recomputation(model, PROMPTS, 12)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_equals_transformers_generate(shape, tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    args = SHAPES[shape]
    model = tiny_model(args)
    (tmp_path / "config.json").write_text(
        json.dumps(to_config(args, torch.float32, 64, None, None))
    )
    state = HFStateDictAdapter(args).to_hf_state_dict(model.state_dict())
    save_file({k: v.clone() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    hf = transformers.GptOssForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="eager"
    ).eval()
    assert generate(model, PROMPTS, 24) == hf_greedy(hf, PROMPTS, 24)


def test_a_sliding_layers_cache_holds_only_its_window():
    """After a 7-token prompt and 24 new tokens (31 slots of max_seq_len 64), a window-4
    layer's cache holds 4 slots, a full layer's 64: the printed sizes are the cache's own."""
    model = tiny_model()
    cache = KVCache(torch.zeros(1, dtype=torch.long), max_seq_len=64)
    sizes = {}
    with torch.no_grad():
        for seq in (7, *([1] * 24)):
            cache.begin(seq)
            x = torch.randn(1, seq, TINY.dim)
            pos = torch.arange(cache.length, cache.length + seq)[None]
            for layer in range(2):  # layer 0 slides (window 4), layer 1 is full
                model.layers[str(layer)].attention(
                    x, model.rope_cos[pos], model.rope_sin[pos], cache.layer(layer)
                )
            cache.end()
    for layer in range(2):
        sizes[layer] = cache._k[layer].shape[1]
    ring, full = cache._k[0].numel() * 4 * 2, cache._k[1].numel() * 4 * 2
    print(f"KV cache of one layer, 31 of 64 slots used: sliding (W=4) {ring} B, full {full} B")
    assert sizes == {0: 4, 1: 64}
    assert cache.cache_bytes() == ring + full
    big = gpt_oss_flavors["120b"]
    per_slot = 2 * big.n_kv_heads * big.head_dim * 2  # k and v, bf16
    sliding = sum(big.layer_window(i) is not None for i in range(big.n_layers))
    full_gib = big.n_layers * per_slot * 131072 / 2**30
    ring_gib = ((big.n_layers - sliding) * 131072 + sliding * 128) * per_slot / 2**30
    print(f"120b at 131,072 tokens, one sequence: {ring_gib:.2f} GiB with rings, "
          f"{full_gib:.2f} GiB with full caches")  # fmt: skip
    assert abs(ring_gib / full_gib - 0.5) < 0.001
