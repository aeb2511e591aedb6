"""Qwen3 flavors: published parameter counts, validation, the q/k norms."""

import dataclasses

import pytest
import torch

from titanlab.models.common.counting import count_params
from titanlab.models.qwen3 import Qwen3ModelArgs, Qwen3Transformer, qwen3_flavors

# (total, non-embedding) parameters in billions as published on the Qwen3 model cards
# (the non-embedding count leaves out the embedding and, when untied, lm_head).
PUBLISHED = {
    "0.6B": (0.6, 0.44),
    "1.7B": (1.7, 1.4),
    "4B": (4.0, 3.6),
    "8B": (8.2, 6.95),
    "14B": (14.8, 13.2),
    "32B": (32.8, 31.2),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_parameter_counts_match_the_published_figures(flavor):
    args = dataclasses.replace(qwen3_flavors[flavor], max_seq_len=8)
    with torch.device("meta"):
        model = Qwen3Transformer(args)
    total = count_params(model)
    embedding = args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2)
    want_total, want_non_embedding = PUBLISHED[flavor]
    # Published figures are rounded to the digits shown.
    digits = 2 if want_non_embedding < 1 or flavor == "8B" else 1
    assert round(total / 1e9, 1) == pytest.approx(want_total, abs=0.051)
    assert round((total - embedding) / 1e9, digits) == pytest.approx(want_non_embedding, abs=1e-9)


def test_8b_and_0_6b_exact_counts():
    for flavor, want in (("0.6B", 596_049_920), ("8B", 8_190_735_360)):
        with torch.device("meta"):
            model = Qwen3Transformer(dataclasses.replace(qwen3_flavors[flavor], max_seq_len=8))
        assert count_params(model) == want, flavor


def test_blocks_have_per_head_qk_norms_of_head_dim():
    args = dataclasses.replace(qwen3_flavors["debugmodel"], vocab_size=100, max_seq_len=16)
    model = Qwen3Transformer(args)
    attn = model.layers["0"].attention
    assert attn.q_norm.weight.shape == (args.head_dim,) == attn.k_norm.weight.shape
    assert args.head_dim != args.dim // args.n_heads  # explicit head_dim, like the published ones
    assert attn.wq.weight.shape == (args.n_heads * args.head_dim, args.dim)
    model.init_weights()
    assert torch.equal(attn.q_norm.weight, torch.ones(args.head_dim))
    out = model(torch.randint(0, 100, (2, 16)))
    assert out.shape == (2, 16, 100) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"head_dim": 7}, "head_dim=7 must be even"),
        ({"n_kv_heads": 3}, "n_kv_heads=3 must be positive and divide n_heads=8"),
        ({"hidden_dim": 0}, "hidden_dim=0 must be positive"),
        ({"vocab_size": -1}, "vocab_size=-1 must be positive"),
    ],
)
def test_validate_names_the_bad_value(change, message):
    args = dataclasses.replace(qwen3_flavors["debugmodel"], **{"vocab_size": 100, **change})
    with pytest.raises(ValueError, match=message):
        args.validate()


def test_defaults_are_qwen3s():
    args = Qwen3ModelArgs()
    assert (args.rope_theta, args.norm_eps, args.qk_norm, args.rope_scaling) == (
        1e6,
        1e-6,
        True,
        None,
    )
