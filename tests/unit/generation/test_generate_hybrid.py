"""Generation with Qwen3.5's hybrid cache (a recurrent state per linear-attention layer, keys and
values per full-attention layer): the cached, left-padded decode equals recomputing each
sequence alone within 1e-5, greedy output equals transformers' `generate` for 24 tokens, and the
linear layers' cache does not grow with the context."""

import dataclasses
import os

import pytest
import torch

from test_generate import PROMPTS, assert_cached_decode_is_recomputation, hf_greedy, tiny_model
from titanlab.generation import generate
from titanlab.models.common.hf_adapter import HFStateDictAdapter
from titanlab.models.common.kv_cache import KVCache
from titanlab.models.registry import get_family, get_flavor

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def hybrid_args(family: str = "qwen3_5"):
    """4 layers (linear, full, linear, full) whose linear heads differ from the full ones."""
    return dataclasses.replace(
        get_flavor(get_family(family), "debugmodel"), dim=64, n_layers=4, n_heads=4,
        n_kv_heads=2, head_dim=16, hidden_dim=96, vocab_size=97, max_seq_len=64,
        full_attention_interval=2, linear_key_heads=2, linear_value_heads=4,
        linear_key_dim=8, linear_value_dim=12,
    )  # fmt: skip


def randomized(model):
    """Norms and the decay away from their init (zero-centered norms start at identity)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.normal_(0.0 if p.ndim == 1 and "attention.norm" not in name else 1.0, 0.3)
    return model


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_cached_hybrid_decode_equals_recomputing_the_whole_sequence(family):
    assert_cached_decode_is_recomputation(randomized(tiny_model(hybrid_args(family), seed=1)))


def test_greedy_equals_transformers_generate():
    transformers = pytest.importorskip("transformers")
    from titanlab.models.qwen3_5.hf import to_config

    args = hybrid_args()
    model = randomized(tiny_model(args, seed=3))
    config = transformers.Qwen3_5TextConfig(**to_config(args, torch.float32, 64, None, None))
    hf = transformers.Qwen3_5ForCausalLM(config).eval()
    hf.load_state_dict(HFStateDictAdapter(args).to_hf_state_dict(model.state_dict()))
    assert generate(model, PROMPTS, 24) == hf_greedy(hf, PROMPTS, 24)


def test_the_linear_layers_cache_is_constant_in_the_context():
    model = tiny_model(hybrid_args(), seed=0)
    sizes = {}
    for length in (8, 40):
        caches: list[KVCache] = []
        generate(model, [list(range(1, length + 1))], 4, cache_out=caches)
        sizes[length] = (caches[0].recurrent_bytes(), caches[0].kv_bytes())
    assert sizes[8][0] == sizes[40][0] > 0  # conv history + delta state: fixed per sequence
    assert sizes[40][1] > sizes[8][1]  # the full layers' keys and values grow
