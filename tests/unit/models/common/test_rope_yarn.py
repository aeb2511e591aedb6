"""YaRN RoPE scaling (`YarnScaling`) against transformers' DeepSeek-V3 and the paper's formulas;
the Llama 3.1 and unscaled paths against a re-derivation of the code before YaRN."""

import itertools
import math

import pytest
import torch

from titanlab.models.common.hf_config import rope_from_config, yarn_to_config
from titanlab.models.common.rope import (
    RopeScaling,
    YarnScaling,
    precompute_rope_cos_sin,
    rope_attention_factor,
    rope_frequencies,
    softmax_mscale,
)

L0 = 4096
QK_NOPE = 16
# (factor, mscale, mscale_all_dim): DeepSeek-V3's own, two asymmetric ones, and no softmax term.
MSCALES = [(40.0, 1.0, 1.0), (4.0, 1.0, 0.707), (4.0, 0.707, 0.707), (4.0, 1.0, 0.0)]
CASES = list(itertools.product((64, 8), MSCALES, (True, False), (1e4, 5e5)))


def case_id(case) -> str:
    rope_dim, (factor, mscale, all_dim), truncate, theta = case
    return f"d{rope_dim}-s{factor:g}-m{mscale:g}-a{all_dim:g}-t{int(truncate)}-th{theta:g}"


def hf_config(rope_dim: int, rope_scaling: dict, theta: float, max_pos: int = 4 * L0):
    """A tiny `DeepseekV3Config` whose RoPE is `rope_scaling` (the legacy key, as published)."""
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV3Config(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=QK_NOPE,
        qk_rope_head_dim=rope_dim,
        v_head_dim=16,
        max_position_embeddings=max_pos,
        rope_theta=theta,
        rope_scaling=dict(rope_scaling),
    )


def yarn(factor: float, mscale: float, all_dim: float, truncate: bool = True) -> YarnScaling:
    return YarnScaling(factor, L0, mscale=mscale, mscale_all_dim=all_dim, truncate=truncate)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_frequencies_and_attention_factor_match_transformers(case):
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    rope_dim, (factor, mscale, all_dim), truncate, theta = case
    scaling = yarn(factor, mscale, all_dim, truncate)
    inv_freq, attention_factor = rope_utils._compute_yarn_parameters(
        hf_config(rope_dim, yarn_to_config(scaling), theta)
    )
    freqs = rope_frequencies(rope_dim, theta, scaling)
    assert freqs.shape == (rope_dim // 2,) and freqs.dtype == torch.float32
    assert torch.equal(freqs, inv_freq)  # same floating-point order: bitwise
    assert rope_attention_factor(scaling) == attention_factor


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cos_sin_match_deepseek_rotary_embedding(case):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    rope_dim, (factor, mscale, all_dim), truncate, theta = case
    scaling = yarn(factor, mscale, all_dim, truncate)
    config = hf_config(rope_dim, yarn_to_config(scaling), theta)
    assert isinstance(config, transformers.DeepseekV3Config)
    end = 2 * L0
    hf_cos, hf_sin = hf.DeepseekV3RotaryEmbedding(config)(
        torch.zeros(1, dtype=torch.float32), torch.arange(end)[None]
    )
    cos, sin = precompute_rope_cos_sin(rope_dim, end, theta, scaling)
    assert cos.shape == sin.shape == (end, rope_dim // 2) and cos.dtype == torch.float32
    # HF's tables are [cos(angles) ; cos(angles)] for its rotate-half layout: compare one half.
    assert torch.equal(hf_cos[0, :, : rope_dim // 2], hf_cos[0, :, rope_dim // 2 :])
    torch.testing.assert_close(cos, hf_cos[0, :, : rope_dim // 2], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0, :, : rope_dim // 2], atol=1e-6, rtol=0)
    factor_applied = rope_attention_factor(scaling)
    assert cos[0].eq(factor_applied).all() and sin[0].eq(0).all()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_softmax_scale_matches_deepseek_attention(case):
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    rope_dim, (factor, mscale, all_dim), truncate, theta = case
    scaling = yarn(factor, mscale, all_dim, truncate)
    hf_scaling = DeepseekV3Attention(hf_config(rope_dim, yarn_to_config(scaling), theta), 0).scaling
    d_qk = QK_NOPE + rope_dim
    assert math.isclose(softmax_mscale(scaling) * d_qk**-0.5, hf_scaling, rel_tol=1e-14)
    assert (softmax_mscale(scaling) == 1.0) == (all_dim == 0.0)


@pytest.mark.parametrize("key", ["absent", "null"])
def test_missing_factor_is_max_positions_over_original(key):
    params = {"type": "yarn", "original_max_position_embeddings": L0}
    if key == "null":
        params["factor"] = None
    cfg = {"max_position_embeddings": 8 * L0, "rope_theta": 1e4, "rope_scaling": params}
    theta, scaling = rope_from_config(cfg, ("default", "yarn"))
    assert theta == 1e4 and scaling == YarnScaling(8.0, L0, mscale=0.0)
    # transformers refuses an absent factor (a KeyError) but derives it from an explicit null.
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    inv_freq, attention_factor = rope_utils._compute_yarn_parameters(
        hf_config(64, dict(params, factor=None), 1e4, max_pos=8 * L0)
    )
    assert torch.equal(rope_frequencies(64, 1e4, scaling), inv_freq)
    assert rope_attention_factor(scaling) == attention_factor == 0.1 * math.log(8.0) + 1.0


def test_deepseek_v3_671b_worked_values():
    scaling = YarnScaling(40.0, 4096, mscale=1.0, mscale_all_dim=1.0)
    d_qk = 128 + 64
    assert rope_attention_factor(scaling) == 1.0
    assert math.isclose(softmax_mscale(scaling), 1.873854, abs_tol=5e-7)
    # docs/design/deepseek_v3.md §1.2 rounds the scale to 6 decimals (0.13523378 exactly).
    assert abs(softmax_mscale(scaling) * d_qk**-0.5 - 0.135234) < 5e-7
    # The ramp runs from pair 10 (corr 10.47, floored) to 23 (corr 22.51, ceiled).
    freqs = rope_frequencies(64, 1e4, scaling)
    plain = rope_frequencies(64, 1e4, None)
    assert torch.equal(freqs[:11], plain[:11])
    torch.testing.assert_close(freqs[23:], plain[23:] / 40, rtol=1e-6, atol=0)
    assert ((freqs[11:23] < plain[11:23]) & (freqs[11:23] > plain[11:23] / 40)).all()
    untruncated = rope_frequencies(64, 1e4, YarnScaling(40.0, 4096, truncate=False))
    assert not torch.equal(untruncated, freqs)


def test_explicit_attention_factor_scales_the_tables():
    scaling = YarnScaling(4.0, L0, mscale_all_dim=1.0, attention_factor=0.5)
    assert rope_attention_factor(scaling) == 0.5
    assert softmax_mscale(scaling) == (0.1 * math.log(4.0) + 1.0) ** 2
    cos, sin = precompute_rope_cos_sin(16, 32, 1e4, scaling)
    plain_cos, plain_sin = precompute_rope_cos_sin(16, 32, 1e4, YarnScaling(4.0, L0, mscale=0.0))
    m = 0.1 * math.log(4.0) + 1.0
    torch.testing.assert_close(cos, plain_cos / m * 0.5, atol=1e-7, rtol=0)
    torch.testing.assert_close(sin, plain_sin / m * 0.5, atol=1e-7, rtol=0)
    # A factor of at most 1 leaves the frequencies and every multiplier alone.
    short = YarnScaling(1.0, L0, mscale_all_dim=1.0)
    assert rope_attention_factor(short) == softmax_mscale(short) == 1.0


def old_frequencies(head_dim, theta, scaling):
    """rope_frequencies as it was before YaRN (None and Llama 3.1 paths)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim)
    if scaling is None:
        return freqs
    orig, low, high = (
        scaling.original_max_position_embeddings,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
    )
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    out = torch.where(wavelen > orig / low, freqs / scaling.factor, blended)
    return torch.where(wavelen < orig / high, freqs, out)


LLAMA_SCALINGS = [None, RopeScaling(factor=8.0), RopeScaling(32.0, 1.0, 4.0, 8192)]


@pytest.mark.parametrize(
    "head_dim,theta,scaling", list(itertools.product((8, 64, 128), (1e4, 5e5), LLAMA_SCALINGS))
)
def test_llama_and_unscaled_paths_bitwise_unchanged(head_dim, theta, scaling):
    freqs = old_frequencies(head_dim, theta, scaling)
    assert torch.equal(rope_frequencies(head_dim, theta, scaling), freqs)
    angles = torch.outer(torch.arange(300, dtype=torch.float32), freqs)
    cos, sin = precompute_rope_cos_sin(head_dim, 300, theta, scaling)
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())
    assert rope_attention_factor(scaling) == softmax_mscale(scaling) == 1.0


ROUND_TRIP = [
    YarnScaling(40.0, 4096, mscale=1.0, mscale_all_dim=1.0),
    YarnScaling(4.0, 32768),
    YarnScaling(4.0, 2048, beta_fast=16.0, beta_slow=2.0, mscale=0.707, mscale_all_dim=0.707),
    YarnScaling(8.0, 8192, attention_factor=0.9, truncate=False),
]


@pytest.mark.parametrize("scaling", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_round_trip_through_config(scaling):
    legacy = yarn_to_config(scaling)
    assert legacy["type"] == legacy["rope_type"] == "yarn"
    assert ("attention_factor" in legacy) == (scaling.attention_factor is not None)
    assert ("truncate" in legacy) == (not scaling.truncate)
    assert rope_from_config({"rope_theta": 5e5, "rope_scaling": legacy}, ("yarn",)) == (
        5e5,
        scaling,
    )
    new_form = {k: v for k, v in legacy.items() if k != "type"} | {"rope_theta": 5e5}
    assert rope_from_config({"rope_parameters": new_form}, ("yarn",)) == (5e5, scaling)
    # transformers reads the dict to the same parameters and writes it back readable.
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    config = hf_config(64, legacy, 5e5)
    inv_freq, attention_factor = rope_utils._compute_yarn_parameters(config)
    assert torch.equal(rope_frequencies(64, 5e5, scaling), inv_freq)
    assert rope_attention_factor(scaling) == attention_factor
    assert rope_from_config(config.to_dict(), ("default", "yarn")) == (5e5, scaling)


def test_deepseek_published_rope_scaling_reads():
    published = {  # DeepSeek-V3's config.json (type only, ints where integral)
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    }
    cfg = {"rope_theta": 10000, "max_position_embeddings": 163840, "rope_scaling": published}
    theta, scaling = rope_from_config(cfg, ("default", "yarn"))
    assert theta == 1e4 and scaling == YarnScaling(40.0, 4096, mscale=1.0, mscale_all_dim=1.0)
    assert yarn_to_config(scaling) == published | {"rope_type": "yarn"}


@pytest.mark.parametrize(
    "cfg,allowed,message",
    [
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            ("default", "llama3"),
            "config.json rope type 'yarn' is not supported; valid: default, llama3",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            ("default", "yarn"),
            "config.json yarn rope scaling lacks 'original_max_position_embeddings'",
        ),
        (
            {"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}},
            ("yarn",),
            "config.json yarn rope scaling lacks 'factor' (and max_position_embeddings to derive it)",
        ),
        (
            {"rope_scaling": {"type": "yarn", "factor": 0, "original_max_position_embeddings": 4}},
            ("yarn",),
            "YarnScaling factor=0.0 must be > 0",
        ),
    ],
)
def test_one_line_errors(cfg, allowed, message):
    with pytest.raises(ValueError) as err:
        rope_from_config(cfg, allowed)
    assert str(err.value) == message


@pytest.mark.parametrize("field", ["factor", "original_max_position_embeddings", "beta_slow"])
def test_yarn_scaling_refuses_non_positive(field):
    kw = {"factor": 4.0, "original_max_position_embeddings": 4096, field: 0}
    with pytest.raises(ValueError, match=f"YarnScaling {field}=0 must be > 0"):
        YarnScaling(**kw)
