"""What a zero-bubble pipeline schedule's split backward holds between its two halves.

The zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split a stage's
backward into the input gradient ("I") and the weight gradient ("W"), run later. torch's
`torch.distributed.pipelining._backward.stage_backward_input` keeps the autograd graph (so the
activations) and, for each node where a weight meets the activations (a Linear's matmul, a
norm's scaling), the gradient of that node's output, from which `stage_backward_weight` later
makes the weight's gradient. So between I and W a stage holds, per microbatch, one gradient of
the size of each weight op's output: `WeightOpOutputs` counts those bytes while tracing.
The first stage is the exception: its I does nothing and its W runs the whole backward
(`PipelineStage.backward_weight_one_chunk`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class WeightOpOutputs(TorchDispatchMode):
    """Sums the bytes of the first output of every op, recorded by autograd (grad mode on: not
    inside a custom autograd function's forward), that takes both a weight (a parameter, or a
    tensor made from weights alone, such as a cast copy or a transpose) and a floating-point
    activation (not the embedding's lookup of token ids: no gradient flows to those).

    Args:
        params: the model's parameters (their storages mark the weights).
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._weights = {StorageWeakRef(p.untyped_storage()).cdata for p in params}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        weights = [StorageWeakRef(t.untyped_storage()).cdata in self._weights for t in tensors]
        activations = [t.is_floating_point() for t, w in zip(tensors, weights) if not w]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(weights) and not activations:  # made from weights alone: a weight too
            self._weights.update(StorageWeakRef(t.untyped_storage()).cdata for t in outs)
        elif any(weights) and any(activations) and outs and torch.is_grad_enabled():
            self.bytes += outs[0].untyped_storage().nbytes()
        return out
