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
