"""What sequence-parallel tensor parallel holds whole on every tp rank, found while tracing the
plain model (`titanlab.planning.activation_memory`).

Under Megatron-style TP with sequence parallel (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4.2.2) the activations between blocks are split
over the sequence, but each column-parallel projection needs the whole sequence: titanlab's plan
(`titanlab.distributed.tensor_parallel.plan`) all-gathers the attention's and the feed-forward's
inputs, and the Linear layers keep that gathered tensor for their weight gradient. Megatron-LM re-gathers it
in backward instead; DTensor keeps it. So of a block's saved bytes, these are not divided by tp,
and neither is the output head's gathered input (or, for the fused loss's head, the gradient of
that input, which it computes in forward).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef


class Gathered:
    """Storages noted while the plain model runs; `live()` sums the bytes of those still
    referenced (held for backward)."""

    def __init__(self) -> None:
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def note(self, t: object) -> None:
        if isinstance(t, torch.Tensor):
            ref = StorageWeakRef(t.untyped_storage())
            self.refs[ref.cdata] = (ref, t.untyped_storage().nbytes())

    def live(self) -> int:
        gc.collect(0)
        return sum(n for ref, n in self.refs.values() if not ref.expired())


def gathering_inputs(style: object) -> list[int]:
    """Positions of the inputs a parallel style all-gathers (declared `Shard`, wanted
    `Replicate`), as `PrepareModuleInput` and `ColwiseParallel(input_layouts=Shard(1))` do."""
    from torch.distributed.tensor import Replicate, Shard

    given = getattr(style, "input_layouts", None)
    wanted = getattr(style, "desired_input_layouts", None)
    if given is None or wanted is None:
        return []
    given = given if isinstance(given, tuple) else (given,)
    wanted = wanted if isinstance(wanted, tuple) else (wanted,)
    return [
        i
        for i, (a, b) in enumerate(zip(given, wanted))
        if isinstance(a, Shard) and isinstance(b, Replicate)
    ]


def watch_gathered(model: nn.Module, storages: Callable[[], dict]) -> Gathered:
    """Hooks on `model` (plain, being traced) noting what
    `titanlab.distributed.tensor_parallel.one_d` would gather: each block's plan entries that gather an input, the output head's input, and
    what the head makes during its forward of its input's size (the fused head's input
    gradient). `storages()`: the tracer's {storage id: (weak ref, bytes)} of created tensors."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    from titanlab.distributed.tensor_parallel.one_d import _block_plan
    from titanlab.models.common.decoder import TransformerBlock

    watch = Gathered()

    def hook(positions: list[int]):
        def pre(_module, args) -> None:
            for i in positions:
                if i < len(args):
                    watch.note(args[i])

        return pre

    for block in (m for m in model.modules() if isinstance(m, TransformerBlock)):
        plan = _block_plan(model, block, ColwiseParallel, RowwiseParallel, PrepareModuleInput)  # type: ignore[arg-type]
        for path, style in plan.items():
            positions = gathering_inputs(style)
            if positions:
                block.get_submodule(path).register_forward_pre_hook(hook(positions))
    output = getattr(model, "output", None)
    if output is not None:
        seen: dict[str, object] = {}

        def head_pre(_module, args) -> None:
            watch.note(args[0])
            seen["before"], seen["nbytes"] = set(storages()), args[0].untyped_storage().nbytes()

        def head_post(_module, _args, _out) -> None:
            for cdata, (ref, n) in list(storages().items()):
                if cdata not in seen["before"] and n == seen["nbytes"]:  # type: ignore[operator]
                    watch.refs[cdata] = (ref, n)

        output.register_forward_pre_hook(head_pre)
        output.register_forward_hook(head_post)
    return watch
