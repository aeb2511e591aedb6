"""Dropout whose mask depends on each element's position in the whole tensor, not on the rank.

LoRA applies dropout to the adapter's input (Hu et al. 2021). Under tensor parallel that input
is a DTensor: replicated before a column-wise layer, split by columns before a row-wise one.
`nn.Dropout` draws each rank's mask from the rank's own generator (DTensor keeps sharded random
ops consistent only on CUDA), so the ranks would drop different elements of what they share and
the result would depend on the layout. `PositionDropout` draws one 64-bit seed per call from
the global torch generator (so activation checkpointing, which keeps the RNG state of a block
with dropout, draws it again in the recompute) and keeps element i of the full tensor when
u(seed, i) >= p, with u a counter-based hash of the seed and i (SplitMix64's finalizer, Steele
et al. 2014, "Fast splittable pseudorandom number generators"). Every rank computes its own
elements' values from their global positions: the mask is the one a single process draws.
"""

from __future__ import annotations

import torch
from torch import nn

# SplitMix64's constants as signed int64 (torch multiplies int64 with two's-complement wrap).
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_BITS = 24  # uniform values on a grid of 2^-24, exact in fp32


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 (logical right shifts done on the unsigned bits)."""
    mask = (1 << 63) - 1

    def shr(v: torch.Tensor, k: int) -> torch.Tensor:  # logical shift of the 64 bits
        return (v >> k) & (mask >> (k - 1))

    z = (z ^ shr(z, 30)) * _MIX1
    z = (z ^ shr(z, 27)) * _MIX2
    return z ^ shr(z, 31)


def keep_mask(
    local_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    offset: tuple[int, ...],
    seed: torch.Tensor,
    p: float,
) -> torch.Tensor:
    """bool mask of the block `local_shape` at `offset` of a tensor of `global_shape`: True
    where the element is kept (probability 1 - p). `seed`: 0-dim int64 on the block's device."""
    index = torch.zeros((), dtype=torch.int64, device=seed.device)
    stride = 1
    for dim in reversed(range(len(global_shape))):
        pos = torch.arange(local_shape[dim], device=seed.device, dtype=torch.int64) + offset[dim]
        index = index + (pos * stride).view([-1] + [1] * (len(global_shape) - 1 - dim))
        stride *= global_shape[dim]
    u = _mix(index + (seed + 1) * _GOLDEN) & ((1 << _BITS) - 1)
    return u >= int(p * (1 << _BITS))


class PositionDropout(nn.Dropout):
    """`nn.Dropout(p)` with the layout-independent mask of the module docstring.

    Shapes: any input (a tensor or a DTensor) → the same shape and dtype; kept elements are
    scaled by 1 / (1 - p), as `nn.Dropout` scales them. Identity in eval mode or at p = 0.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        seed = torch.randint(-(2**62), 2**62, (), dtype=torch.int64)  # the global generator
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local = x.to_local()
            shape, offset = compute_local_shape_and_global_offset(
                x.shape, x.device_mesh, x.placements
            )
            keep = keep_mask(
                tuple(shape), tuple(x.shape), tuple(offset), seed.to(local.device), self.p
            )
            out = local * keep.to(local.dtype) / (1 - self.p)
            return DTensor.from_local(
                out, x.device_mesh, x.placements, shape=x.shape, stride=x.stride(), run_check=False
            )
        keep = keep_mask(tuple(x.shape), tuple(x.shape), (0,) * x.dim(), seed.to(x.device), self.p)
        return x * keep.to(x.dtype) / (1 - self.p)
