"""Statistics counted once per training forward, also inside compiled code: `add_once`.

An activation-checkpointed block runs its forward again in backward to recompute what it did not
keep; a count taken in forward (an MoE layer's tokens per expert, its load-balance loss, the
slots a capacity-bounded dispatch dropped) must not be taken again then. Whether autograd's
engine is running (`torch._C._current_graph_task_id() != -1`) is a question Dynamo cannot trace
(a graph break, so no whole-block compile), so the test and the add run inside a custom op,
opaque to the compiler and run as eager code each time the compiled graph runs (PyTorch docs,
"Python Custom Operators", `torch.library.custom_op` with `mutates_args`).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("titanlab::add_once", mutates_args=("total",))
def add_once(total: torch.Tensor, value: torch.Tensor) -> None:
    """`total += value` (cast to total's dtype; shapes broadcast as `Tensor.add_`), unless
    autograd's backward is running (a checkpointed forward's recomputation), where nothing is
    added. `value` is read without gradient."""
    if torch._C._current_graph_task_id() == -1:
        total.add_(value.detach().to(total.dtype))


@add_once.register_fake
def _(total: torch.Tensor, value: torch.Tensor) -> None:
    return None
