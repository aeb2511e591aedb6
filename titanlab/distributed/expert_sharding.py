"""How FSDP2 shards MoE experts' weights: expert-parallel ones over their expert-FSDP (efsdp)
ranks, the others over their block's FSDP ranks.

An expert stack's weight is (local experts, ...) on each expert-parallel rank. FSDP2 shards a
parameter on dim 0 by default, in `torch.chunk`'s pieces padded to the first one's size: with
fewer local experts than efsdp ranks (Qwen3-MoE 235B at EP 16 on 256 ranks: 8 local experts
over 16 ranks) every rank allocates a whole expert, twice the even share, and half the ranks
hold only padding. `expert_shard_dim` picks a dim that splits evenly instead (FSDP2's
`shard_placement_fn`, as torchtitan shards such experts on dim 1), and `held_elements` counts
what a rank holds, padding included, for the memory estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from titanlab.distributed.parallel_dims import ParallelDims
from titanlab.config.device_path import device_type


def expert_shard_dim(local_shape: tuple[int, ...], ranks: int) -> int:
    """The dim FSDP2 shards an expert weight of `local_shape` on over `ranks` efsdp ranks: 0
    (the local experts) when it splits evenly, else the first other dim that does, else 0
    padded (FSDP2 pads only dim 0: it refuses an uneven split of any other)."""
    for dim, size in enumerate(local_shape):
        if size % ranks == 0:
            return dim
    return 0


def held_elements(local_shape: tuple[int, ...], ranks: int) -> int:
    """Elements of an expert weight of `local_shape` (this expert-parallel rank's experts) that
    one efsdp rank allocates: FSDP2's shard of `expert_shard_dim`, padded to ceil(size / ranks)
    (every rank allocates the padded size)."""
    if not local_shape:
        return 1
    dim = expert_shard_dim(local_shape, ranks)
    rest = math.prod(local_shape) // local_shape[dim]
    return -(-local_shape[dim] // ranks) * rest


def shard_placement(ranks: int) -> Callable[[nn.Parameter], Shard]:
    """FSDP2's `shard_placement_fn` for an expert stack sharded over `ranks` efsdp ranks."""

    def place(param: nn.Parameter) -> Shard:
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(expert_shard_dim(tuple(local.shape), ranks))

    return place


def block_placement(block: nn.Module, ranks: int) -> Callable[[nn.Parameter], Shard | None] | None:
    """FSDP2's `shard_placement_fn` for a block whose MoE experts are not expert-parallel: its
    expert stacks (all the experts, in the block's unit) on `expert_shard_dim` over the block's
    `ranks` FSDP ranks, every other weight on FSDP2's default (None: dim 0). None for a block
    without experts. Without it, 128 experts over 256 FSDP ranks leave half the ranks with
    padding and rank 0 with twice the even share."""
    from titanlab.models.common.decoder import moe_layers

    stacks = [p for moe in moe_layers(block) for p in moe.experts.parameters()]
    if not stacks:
        return None
    place = shard_placement(ranks)

    def place_in_block(param: nn.Parameter) -> Shard | None:
        return place(param) if any(param is stack for stack in stacks) else None

    return place_in_block


@dataclass
class ExpertSharding:
    """FSDP of expert-parallel experts: their own mesh, gradient divide factor and placement."""

    mesh: DeviceMesh
    grad_divide_factor: float
    sum_reduce: bool
    """Reduce with SUM then divide (gloo has no PREMUL_SUM, which FSDP uses for a custom divide
    factor)."""

    @property
    def shard_ranks(self) -> int:
        """The efsdp ranks a weight is split over (the mesh's last dim; HSDP replicates over
        its first)."""
        return self.mesh.size(self.mesh.ndim - 1)


def expert_fsdp(parallel_dims: ParallelDims, device: torch.device) -> ExpertSharding | None:
    """How FSDP shards expert-parallel experts (None without ep): over efsdp, replicated over
    dp_replicate under HSDP."""
    if not parallel_dims.ep_enabled:
        return None
    efsdp = parallel_dims.mesh("efsdp")
    assert efsdp is not None  # built whenever ep > 1
    mesh = (
        parallel_dims.root_slice("dp_replicate", "efsdp")
        if parallel_dims.dp_replicate_enabled
        else efsdp
    )
    # The dense gradients are averaged over every data-parallel rank (dp_replicate × dp_shard
    # × cp); an expert's gradient already sums the tokens of its ep ranks (the all-to-all's
    # backward), so FSDP must divide it by the same count, not by its own mesh's size.
    dp_ranks = parallel_dims.dp_replicate * parallel_dims.dp_shard * parallel_dims.cp
    # Without a reduce-scatter (efsdp of 1 rank) FSDP divides while copying, then again after
    # the reduction when told to sum (torch 2.13): sum only when efsdp really reduce-scatters.
    sum_reduce = device_type(device) != "cuda" and efsdp.size() > 1
    return ExpertSharding(mesh, float(dp_ranks), sum_reduce=sum_reduce)
