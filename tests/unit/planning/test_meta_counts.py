"""The planner's remembered parameter counts equal counting afresh, per module object."""

import dataclasses

import torch

from titanlab.models.common.counting import count_params
from titanlab.models.common.decoder import moe_layers
from titanlab.models.qwen3_moe import qwen3_moe_flavors
from titanlab.models.registry import build_model
from titanlab.planning import meta_counts


def meta_moe(n_layers: int):
    args = dataclasses.replace(qwen3_moe_flavors["debugmodel"], n_layers=n_layers, vocab_size=512)
    with torch.device("meta"):
        return build_model(args)


def test_counts_equal_counting_afresh_for_the_model_its_blocks_and_experts():
    model = meta_moe(2)
    for module in [model, *model.layers.values(), model.tok_embeddings]:
        assert meta_counts.params(module) == count_params(module)
        assert meta_counts.moe_layers(module) == moe_layers(module)
        experts = sum(sum(p.numel() for p in m.experts.parameters()) for m in moe_layers(module))
        assert meta_counts.expert_params(module) == experts
    assert meta_counts.expert_params(model) > 0


def test_another_model_object_is_counted_for_itself():
    small, large = meta_moe(2), meta_moe(3)
    assert meta_counts.params(small) == count_params(small)
    assert meta_counts.params(large) == count_params(large) > meta_counts.params(small)
    assert len(meta_counts.moe_layers(large)) == 3


def test_tp_whole_params_are_what_the_tp_plan_leaves_unsplit():
    # DeepSeek-V3 16B: shared experts, MLA's wkv_a, routers and norms stay whole on every tp
    # rank (the pick ws16-hsdp2x4-tp2-ep8 held 3% more than the even share estimated)
    from titanlab.models.deepseek_v3 import deepseek_v3_flavors

    with torch.device("meta"):
        model = build_model(deepseek_v3_flavors["16B"])
    whole_names = ("shared_experts.", "wkv_a.", "router.", "norm.")
    expected = sum(
        p.numel() for n, p in model.named_parameters() if any(w in n for w in whole_names)
    )
    assert meta_counts.tp_whole_params(model) == expected
    assert 0.48e9 < expected < 0.49e9
    block = model.layers["1"]
    assert meta_counts.tp_whole_params(model, block) == sum(
        p.numel() for n, p in block.named_parameters() if any(w in n for w in whole_names)
    )
