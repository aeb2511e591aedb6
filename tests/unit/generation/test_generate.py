"""Generation: the KV-cached decode equals recomputing the whole sequence, greedy output equals
transformers' `generate` on the same weights, seeded sampling is reproducible, bad input is one
line."""

import dataclasses
import os

import pytest
import torch

from titanlab.generation import SamplingParams, generate, sample_next
from titanlab.models.common.hf_adapter import HFStateDictAdapter
from titanlab.models.llama3 import Transformer, llama3_flavors
from titanlab.models.registry import build_model, get_flavor, get_family

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = dataclasses.replace(
    llama3_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97,
    max_seq_len=64,
)  # fmt: skip
PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 8, 30], [1], [12, 13, 14, 15, 16]]


def tiny_model(args=TINY, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(args)
    model.init_weights()
    return model.eval()


def qwen3_tiny():
    args = dataclasses.replace(
        get_flavor(get_family("qwen3"), "debugmodel"), dim=64, n_layers=2, n_heads=4,
        n_kv_heads=2, head_dim=16, vocab_size=97, max_seq_len=64,
    )  # fmt: skip
    return tiny_model(args)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_cached_decode_equals_recomputing_the_whole_sequence(family):
    assert_cached_decode_is_recomputation(tiny_model() if family == "llama3" else qwen3_tiny())


def assert_cached_decode_is_recomputation(model, prompts=PROMPTS, steps: int = 12) -> None:
    """Each step's logits of a cached, left-padded batch equal the model's on that sequence
    alone (no cache, no padding), within 1e-5."""
    logits: list[torch.Tensor] = []
    out = generate(model, prompts, steps, step_logits=logits)
    assert [len(o) for o in out] == [steps] * len(prompts) and len(logits) == steps
    with torch.no_grad():
        for step, step_logits in enumerate(logits):
            for b, prompt in enumerate(prompts):
                seq = torch.tensor([prompt + out[b][:step]])
                want = model(seq)[0, -1]  # (vocab,): this sequence alone, no cache, no padding
                torch.testing.assert_close(step_logits[b], want, atol=1e-5, rtol=0)


def test_greedy_equals_transformers_generate():
    transformers = pytest.importorskip("transformers")
    from titanlab.models.llama3.hf import to_config

    model = tiny_model(seed=3)
    config = transformers.LlamaConfig(**to_config(TINY, torch.float32, 64, None, None))
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.load_state_dict(HFStateDictAdapter(TINY).to_hf_state_dict(model.state_dict()))
    assert generate(model, PROMPTS, 24) == hf_greedy(hf, PROMPTS, 24)


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate` of each prompt, the batch left-padded (as generation
    with a batch needs): the new tokens only."""
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p) :] = torch.tensor(p)
        mask[b, longest - len(p) :] = 1
    return hf.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
        pad_token_id=0, eos_token_id=None,
    )[:, longest:].tolist()  # fmt: skip


def test_seeded_sampling_is_reproducible_and_the_filters_narrow_it():
    model = tiny_model()
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    a = generate(model, PROMPTS, 16, params=params, seed=7)
    assert a == generate(model, PROMPTS, 16, params=params, seed=7)
    assert a != generate(model, PROMPTS, 16, params=params, seed=8)
    greedy = generate(model, PROMPTS, 16)
    assert generate(model, PROMPTS, 16, params=SamplingParams(1.0, top_k=1), seed=1) == greedy
    assert generate(model, PROMPTS, 16, params=SamplingParams(1.0, top_p=1e-6), seed=1) == greedy


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {
        int(sample_next(logits, SamplingParams(1.0, top_p=0.75), torch.Generator().manual_seed(s)))
        for s in range(200)
    }
    assert seen == {0, 1}  # 0.5 < 0.75 ≤ 0.5 + 0.3


def test_generation_stops_at_eos_per_sequence():
    model = tiny_model()
    free = generate(model, PROMPTS, 10)
    eos = free[1][3]  # a token sequence 1 produces at its 4th step
    out = generate(model, PROMPTS, 10, eos_ids=[eos])
    for b in range(4):
        cut = free[b].index(eos) + 1 if eos in free[b] else 10
        assert out[b] == free[b][:cut]


@pytest.mark.parametrize(
    "prompts,new,params,message",
    [
        ([[1] * 60], 5, SamplingParams(), "a prompt of 60 tokens + max_new_tokens=5 exceeds max_seq_len=64"),
        ([[1]], 5, SamplingParams(1.0, top_p=0.0), "top_p=0.0 must be in (0, 1]"),
        ([[1]], 5, SamplingParams(1.0, top_p=1.5), "top_p=1.5 must be in (0, 1]"),
        ([[1]], 5, SamplingParams(-1.0), "temperature=-1.0 must be >= 0"),
        ([[1]], 0, SamplingParams(), "max_new_tokens=0 must be >= 1"),
        ([[]], 3, SamplingParams(), "every prompt needs at least one token"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(prompts, new, params, message):
    with pytest.raises(ValueError) as e:
        generate(tiny_model(), prompts, new, params=params)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_training_forward_is_unchanged_by_the_cache_argument():
    model = tiny_model()
    x = torch.randint(0, 97, (2, 16))
    assert torch.equal(model(x), Transformer.forward(model, x))
