"""Shortened copies of every family's every flavor: buildable, with the model's block kinds."""

import dataclasses

import pytest
import torch

from titanlab.models.common.shortened import shortened
from titanlab.models.registry import FAMILIES, build_model, get_family

FLAVORS = [(family, flavor) for family in FAMILIES for flavor in get_family(family).flavors]


def kinds(args) -> list[str]:
    """Each block's kind: "moe" or "dense" (the decoder's rule, `moe_layer(layer_id)`)."""
    moe_layer = getattr(args, "moe_layer", lambda i: None)
    return ["moe" if moe_layer(i) is not None else "dense" for i in range(args.n_layers)]


@pytest.mark.parametrize(("family", "flavor"), FLAVORS)
def test_every_flavor_shortens_to_a_buildable_model_with_its_block_kinds(family, flavor):
    args = dataclasses.replace(get_family(family).flavors[flavor], vocab_size=256)
    full = kinds(args)
    for n in (1, 2, 4):
        short = shortened(args, n)
        short.validate()  # DeepSeek-V3 671B: n_dense_layers 3 > 1 block raised here before
        assert short.n_layers == min(n, args.n_layers)
        with torch.device("meta"):
            model = build_model(short)
        assert len(model.layers) == short.n_layers
        got = kinds(short)
        assert got[0] == full[0]  # the first block as it is
        if n >= 2:  # and every kind the model has (dense first blocks, then MoE)
            assert set(got) == set(full)
        assert getattr(short, "mtp_layers", 0) == getattr(args, "mtp_layers", 0)


def test_deepseek_v3_671b_keeps_one_dense_block_then_moe_blocks():
    args = get_family("deepseek_v3").flavors["671B"]
    assert kinds(shortened(args, 1)) == ["dense"]
    assert kinds(shortened(args, 2)) == ["dense", "moe"]
    assert kinds(shortened(args, 4)) == ["dense", "moe", "moe", "moe"]


def test_qwen3_moe_keeps_the_sparse_step_and_the_dense_layers_within_the_copy():
    base = get_family("qwen3_moe").flavors["debugmodel"]
    args = dataclasses.replace(base, decoder_sparse_step=2, mlp_only_layers=(1, 5))
    short = shortened(args, 4)
    assert short.decoder_sparse_step == 2 and short.mlp_only_layers == (1,)
    assert kinds(short) == ["dense", "dense", "dense", "moe"]


def test_a_copy_no_shorter_than_the_model_is_the_model_and_zero_blocks_are_refused():
    args = get_family("llama3").flavors["debugmodel"]
    assert shortened(args, args.n_layers) is args
    with pytest.raises(ValueError, match="n_layers=0 must be >= 1"):
        shortened(args, 0)
