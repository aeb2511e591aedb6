"""Published Llama 3 flavors: parameter counts, FFN widths, FLOPs, argument validation."""

import dataclasses

import pytest
import torch

from titanlab.models.llama3 import (
    Transformer,
    TransformerModelArgs,
    count_params,
    flops_per_token,
    get_nparams_and_flops,
    llama3_flavors,
)

# Totals as published by Meta / Hugging Face model cards, re-derived by hand from the dims:
# 2*V*d (untied) or V*d (tied) + L*(2*d*d + 2*d*kv*hd + 3*d*ffn + 2*d) + d.
PARAMS = {
    "1B": 1_235_814_400,
    "3B": 3_212_749_824,
    "8B": 8_030_261_248,
    "70B": 70_553_706_496,
    "405B": 405_853_388_800,
}
FFN = {"1B": 8192, "3B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_published_param_counts_on_meta(name):
    args = llama3_flavors[name]
    with torch.device("meta"):
        model = Transformer(args)
    assert count_params(model) == PARAMS[name]
    tied = args.tie_word_embeddings
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    # Tied: the table is also the output matmul, so it stays in the non-embedding count.
    expected_non_emb = PARAMS[name] - (0 if tied else args.vocab_size * args.dim)
    assert count_params(model, exclude_embedding=True) == expected_non_emb


@pytest.mark.parametrize("name", sorted(FFN))
def test_ffn_hidden_dims(name):
    assert llama3_flavors[name].ffn_hidden_dim() == FFN[name]


def test_published_flavor_details():
    f = llama3_flavors
    assert [f[n].vocab_size for n in PARAMS] == [128256] * 5
    assert {f[n].rope_scaling.factor for n in ("1B", "3B")} == {32.0}
    assert {f[n].rope_scaling.factor for n in ("8B", "70B", "405B")} == {8.0}
    assert all(f[n].rope_scaling.original_max_position_embeddings == 8192 for n in PARAMS)
    assert [f[n].head_dim for n in ("1B", "3B", "8B")] == [64, 128, 128]
    debug = f["debugmodel"]
    assert (debug.n_heads, debug.kv_heads, debug.rope_scaling.factor) == (8, 4, 8.0)


def test_flops_per_token_8b():
    args = llama3_flavors["8B"]
    n_non_emb = 8_030_261_248 - 128256 * 4096
    expected = 6 * n_non_emb + 12 * 32 * 32 * 128 * 8192
    assert expected == 57_914_449_920
    assert flops_per_token(args, 8192, n_non_emb) == expected
    with torch.device("meta"):
        model = Transformer(args)
    assert get_nparams_and_flops(model, args, 8192) == (8_030_261_248, expected)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(dim=100, n_heads=8), "dim=100"),
        (dict(n_heads=8, n_kv_heads=3), "n_kv_heads=3"),
        (dict(dim=24, n_heads=8, n_kv_heads=None), "head_dim=3"),
        (dict(vocab_size=-1), "vocab_size=-1"),
        (dict(n_layers=0), "n_layers=0"),
        (dict(ffn_dim_multiplier=-1.0), "ffn_dim_multiplier"),
    ],
)
def test_validate_errors(change, match):
    args = dataclasses.replace(llama3_flavors["debugmodel"], **{"vocab_size": 32, **change})
    with pytest.raises(ValueError, match=match):
        args.validate()
    with pytest.raises(ValueError, match=match):
        Transformer(args)


def test_validate_accepts_defaults():
    TransformerModelArgs(vocab_size=10).validate()
