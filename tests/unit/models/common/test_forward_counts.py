"""`titanlab.models.common.forward_counts.add_once`: a count taken in forward is not taken again
when an activation checkpoint recomputes that forward in backward, and compiled code keeps it
(the custom op runs as eager code, so Dynamo traces the caller in one graph)."""

from __future__ import annotations

import torch
import torch._dynamo
from torch.utils.checkpoint import checkpoint

from titanlab.models.common.forward_counts import add_once


def _counted(total: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    add_once(total, x.sum())
    return x * 2


def test_a_checkpointed_forward_counts_once():
    total = torch.zeros(())
    x = torch.ones(3, requires_grad=True)
    checkpoint(_counted, total, x, use_reentrant=False).sum().backward()
    assert total.item() == 3.0  # the recomputation in backward added nothing
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    _counted(total, x)
    assert total.item() == 6.0


def test_the_count_traces_in_one_graph_and_counts_once_compiled():
    total = torch.zeros(())
    x = torch.ones(3, requires_grad=True)
    explained = torch._dynamo.explain(_counted)(total, x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    total.zero_()
    compiled = torch.compile(_counted, backend="aot_eager", fullgraph=True)
    checkpoint(compiled, total, x, use_reentrant=False).sum().backward()
    assert total.item() == 3.0
