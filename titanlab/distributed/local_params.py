"""Running a model's own code on the local shards of its DTensor parameters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@contextlib.contextmanager
def local_parameters(modules: list[nn.Module]) -> Iterator[None]:
    """Within this context every DTensor parameter of `modules` is replaced by a plain
    parameter over its local shard (the same storage), and put back after.

    In-place writes inside the context land in the shards, without DTensor's dispatch: no
    sharding propagation (seconds for an initialization on a 3-D mesh, where each parameter
    shape is a new cache entry) and no distributed random-number tracking. For code whose
    values are overwritten next, such as a CPU initialization that a full single-process copy
    then replaces (`titanlab.components.builders.init_model_weights`).
    """
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in modules:
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if isinstance(p, DTensor):
                    swapped.append((sub, name, p))
                    local = nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
                    sub._parameters[name] = local
    try:
        with torch.no_grad():
            yield
    finally:
        for sub, name, p in swapped:
            sub._parameters[name] = p
