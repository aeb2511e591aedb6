"""`random_weights_skipped`: a family's `init_weights` within it sets the buffers and constant
weights but draws no random weight (and nothing from the generator)."""

import dataclasses

import torch

from titanlab.components.builders import build_meta_model
from titanlab.models.common.init import random_weights_skipped
from titanlab.models.gpt_oss import gpt_oss_flavors

# MoE experts, attention sinks, norms and RoPE tables: every kind of init of the families
ARGS = dataclasses.replace(gpt_oss_flavors["debugmodel"], n_layers=2, vocab_size=256)


def test_skipped_init_sets_buffers_and_constants_and_draws_nothing():
    model = build_meta_model(ARGS)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
        for b in model.buffers():
            b.fill_(7.0)
    torch.manual_seed(0)
    with random_weights_skipped(), torch.no_grad():
        model.init_weights()
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))  # nothing was drawn
    params = dict(model.named_parameters())
    for name in ("layers.0.attention.wq.weight", "tok_embeddings.weight", "output.weight",
                 "layers.0.attention.sinks.weight", "layers.0.feed_forward.experts.gate_up_proj"):  # fmt: skip
        assert (params[name] == 7).all(), name
    assert (params["norm.weight"] == 1).all()  # constants are still set
    assert (model.rope_cos != 7).any()  # and buffers
    with torch.no_grad():
        model.init_weights()  # outside, the random weights are drawn
    wq = params["layers.0.attention.wq.weight"]
    assert wq.abs().max() < 1 and 0.01 < wq.std() < 0.03
