"""Under tensor or context parallel the blocks compile afresh: inductor's on-disk caches hold
compiled code with process-group names written in, and a run handed another layout's graph
trained on gradients 5e-4 off eager's (measured; `apply_compile`'s docstring). Without
collectives in the graph the caches stay on (a warm start: 2.9 s against 23 s per graph)."""

import dataclasses

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

from titanlab.distributed.compile import apply_compile
from titanlab.models.llama3 import llama3_flavors
from titanlab.models.registry import build_model


@pytest.mark.parametrize("collectives", [True, False])
def test_the_on_disk_caches_are_off_only_with_collectives_in_the_graph(collectives):
    args = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=1, vocab_size=64)
    with torch.device("meta"):
        model = build_model(args)
    with (
        torch._inductor.config.patch(fx_graph_cache=True),
        torch._functorch.config.patch(enable_autograd_cache=True),
    ):
        apply_compile(model, "inductor", collectives_in_graph=collectives)
        assert torch._inductor.config.fx_graph_cache is not collectives
        assert torch._functorch.config.enable_autograd_cache is not collectives
