"""The shared body of the 2D / 2.5D / 3D tensor-parallel tests (run inside a spawned rank): a
2-layer debug Llama built once, copied and sharded by `shard(model)`, both trained one step on
the same batch; the losses, the worst gradient difference, the parameters whose gradients
left their placements, and each parameter's full and local shapes."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch


def against_one_process(
    shard: Callable[[torch.nn.Module], None], loss_wrap: Callable, batch: int
) -> tuple[torch.nn.Module, object, dict]:
    """(the sharded model, its args, the result dict) of one step of `batch` × 32 tokens
    (a few labels ignored); `loss_wrap(cross_entropy_sum)` is the sharded model's loss."""
    from torch.distributed.tensor import DTensor

    from titanlab.components.loss import cross_entropy_sum
    from titanlab.models.llama3 import llama3_flavors
    from titanlab.models.registry import build_model

    args = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=512, n_layers=2)
    torch.manual_seed(0)
    ref = build_model(args)
    ref.init_weights()
    model = copy.deepcopy(ref)
    shard(model)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (batch, 32), generator=g)
    labels = torch.randint(0, 512, (batch, 32), generator=g)
    labels[1, :5] = -100
    want = cross_entropy_sum(ref(tokens), labels)
    want.backward()
    got = loss_wrap(cross_entropy_sum)(model(tokens), labels)
    got.backward()
    worst, moved, shapes = 0.0, [], {}
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
        moved += [name] if p.grad.placements != p.placements else []
        worst = max(worst, (p.grad.full_tensor() - p_ref.grad).abs().max().item())
        shapes[name] = [list(p.shape), list(p.to_local().shape)]
    result = {"loss": [want.item(), got.item()], "worst": worst, "moved": moved,
              "shapes": shapes, "tokens": int((labels != -100).sum())}  # fmt: skip
    return model, args, result
