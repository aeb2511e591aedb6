"""Bytes a `torch.compile`d function keeps for backward, read from its compiled forward graph.

Under torch.compile, AOT Autograd traces forward and backward together and a min-cut
partitioner chooses which intermediates the forward saves and which the backward recomputes
(cheap pointwise ops are recomputed), so a compiled block keeps fewer bytes than the same code
run eagerly. The forward graph returns the user outputs followed by the saved tensors; this
module compiles the function with a backend that only records those saved tensors (run on
fake tensors: no memory, no compute) and sums the storages that are not graph inputs.
Source: `torch._functorch.partitioners.min_cut_rematerialization_partition`, the partitioner
Inductor uses by default.
"""

from __future__ import annotations

import logging

from typing import Any
from collections.abc import Callable, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def saved_bytes_compiled(fn: Callable[..., Any], *inputs: Any) -> int:
    """Bytes of the new tensors `torch.compile(fn)` saves for backward on `inputs`.

    Args:
        fn: a function or module (fullgraph-compilable); inputs: its arguments, fake tensors
            (created under a `FakeTensorMode` that is active during this call), some with
            requires_grad.
    Returns:
        the summed storage bytes of the forward graph's outputs (the user outputs and the
        tensors saved for backward) that are not views of an input (weights and the block's
        input are counted elsewhere), each storage once.
    """
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module_simplified

    found: list[int] = []

    def forward_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        inputs = {
            StorageWeakRef(n.meta["val"].untyped_storage()).cdata
            for n in gm.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
        }
        output = next(n for n in gm.graph.nodes if n.op == "output")
        seen: dict[int, int] = {}
        for node in output.args[0]:
            value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                key = StorageWeakRef(storage).cdata
                if key not in inputs:
                    seen[key] = int(storage.nbytes())
        found.append(sum(seen.values()))
        return make_boxed_func(gm.forward)

    def backward_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        return make_boxed_func(gm.forward)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=forward_compiler,
            bw_compiler=backward_compiler,
            partition_fn=min_cut_rematerialization_partition,
        )

    # Selective AC under compile makes torch warn about in-place ops once; the trainer's own
    # compile warns for real, a pre-flight estimate should not.
    sac_log = logging.getLogger("torch._higher_order_ops.wrap")
    level = sac_log.level
    sac_log.setLevel(logging.ERROR)
    torch._dynamo.reset()
    try:
        # static shapes: a planner asks for many batch sizes, and dynamo would otherwise turn
        # a changed size symbolic (its automatic dynamic shapes), leaving SymInt byte counts
        out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*inputs)
        del out
    finally:
        torch._dynamo.reset()
        sac_log.setLevel(level)
    # The user outputs are counted too: a block's output is the next block's input, which that
    # block saves (its own input is a graph input, left out above).
    return sum(found)
