"""Weight initialisation helpers shared by the families: each family's `init_weights` draws its
random weights through `trunc_normal_` and `normal_`, which `random_weights_skipped` can turn
off for a caller that overwrites every parameter afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

_SKIPPED = False


def trunc_normal_(w: torch.Tensor, std: float, cutoff: float = 3.0) -> None:
    """Truncated normal init at +-cutoff*std (realised std ~0.986*std for cutoff 3)."""
    if not _SKIPPED:
        nn.init.trunc_normal_(w, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)


def normal_(w: torch.Tensor, std: float) -> None:
    """Normal init, mean 0."""
    if not _SKIPPED:
        nn.init.normal_(w, mean=0.0, std=std)


@contextlib.contextmanager
def random_weights_skipped() -> Iterator[None]:
    """Within: `trunc_normal_` and `normal_` leave their tensors as they are (and draw nothing
    from the random generator), while `init_weights` still sets the buffers (RoPE tables, MoE
    counters) and the constant weights (norms' ones, zero biases). For a caller that then
    overwrites every randomly initialized parameter: the CPU path of
    `titanlab.components.builders.init_model_weights`, whose shards are cut from a full copy
    (the normal draws are ~11 ns per element on one core, most of a debug model's start)."""
    global _SKIPPED
    before, _SKIPPED = _SKIPPED, True
    try:
        yield
    finally:
        _SKIPPED = before
