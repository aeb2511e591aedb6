"""Expert parallel (ep): each MoE layer's routed experts split over the ep ranks, every token slot
sent to the rank that holds its expert by all-to-all and its output sent back.

Applied from outside the model, like tensor parallel, as a `ParallelStyle` on each MoE layer's
`experts` module (`titanlab.models.common.moe.GroupedExperts`):

- the stacked weights w1, w2, w3 (E, out, in) become DTensors `Shard(0)` over ep, so ep rank i
  holds experts [i·E/ep, (i+1)·E/ep) and a checkpoint holds the global (E, out, in) tensors
  (it loads into any ep degree);
- dispatch, before the experts run: the MoE layer hands over its token slots sorted by expert
  with the per-expert counts (E,). The counts go first (`all_to_all_single`, E/ep to each peer),
  so every rank knows how many slots it sends and receives; then the slots themselves with
  those split sizes (`all_to_all_single_autograd`, whose backward is the reverse exchange).
  Received slots arrive grouped by source rank, then local expert; a permutation regroups them
  by local expert, then source rank, the order the grouped experts need;
- combine, after: the inverse permutation and the reverse all-to-all hand every slot's output
  back to the rank and position it came from, so the MoE layer weights and sums them as on one
  rank. No slot is dropped.

With a capacity factor (`parallelism.expert_capacity_factor` > 0) the exchange is instead the
capacity-bounded one of `titanlab.distributed.expert_capacity`: static splits, no host read,
slots past an expert's capacity dropped and counted; with `parallelism.expert_dispatch_chunks`
> 1 it is cut into chunks whose all-to-alls overlap the other chunks' experts.

The dispatch/combine pattern is GShard's (Lepikhin et al. 2020, "GShard: Scaling Giant Models
with Conditional Computation and Automatic Sharding", section 2.2); the ParallelStyle hooks are
torch's `distribute_module` (torch.distributed.tensor documentation).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from titanlab.config import host_reads
from titanlab.distributed.expert_capacity import (
    aligned_capacity,
    capacity_combine,
    capacity_dispatch,
    chunked_capacity,
    expert_capacity,
    overlapped_exchange,
)
from titanlab.models.common.decoder import moe_layers
from titanlab.models.common.forward_counts import add_once
from titanlab.models.common.moe import MoE


@dataclass
class _Exchange:
    """How one forward's slots were exchanged, kept for the combine."""

    send_splits: list[int]
    """Slots this rank sent to each ep peer."""
    recv_splits: list[int]
    """Slots this rank received from each ep peer."""
    order: torch.Tensor
    """(received slots,) int64: received position of the i-th slot in local-expert order."""


class ExpertParallel(ParallelStyle):
    """Shard a `GroupedExperts` module's experts over a 1-D ep mesh and route its inputs.

    The module's forward takes (x (slots, dim) sorted by expert, counts (E,) int64) and returns
    (slots, dim) in the same order; under this style it runs on the slots of its E/ep experts
    gathered from every ep rank. E must be divisible by the ep degree.

    Args:
        capacity_factor: 0, the exact exchange; > 0, the capacity-bounded one
            (`titanlab.distributed.expert_capacity`), for which the module must have a
            `record_dropped(count)` (`apply_ep` gives it).
        dispatch_chunks: > 1 (with a capacity factor only): the exchange overlapped in that
            many chunks (`expert_capacity.overlapped_exchange`), around the module's forward.

    Raises ValueError for dispatch_chunks < 1, or > 1 without a capacity factor.
    """

    def __init__(self, capacity_factor: float = 0.0, dispatch_chunks: int = 1):
        super().__init__()
        if dispatch_chunks < 1 or (dispatch_chunks > 1 and not capacity_factor > 0):
            raise ValueError(
                f"dispatch_chunks={dispatch_chunks} must be 1, or > 1 with a capacity factor "
                f"> 0 (got {capacity_factor})"
            )
        self.capacity_factor = capacity_factor
        self.dispatch_chunks = dispatch_chunks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.capacity_factor > 0:  # every group ep · C / chunks rows, `_aligned`
            module.groups_aligned = True  # type: ignore[assignment]
        if self.dispatch_chunks > 1:
            distribute_module(module, device_mesh, partition_fn=_shard_experts)
            _overlap(module, device_mesh, self.capacity_factor, self.dispatch_chunks)
            return module
        dispatch, combine = _dispatch, _combine
        if self.capacity_factor > 0:
            factor = self.capacity_factor

            def dispatch(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
                x, counts = inputs  # distribute_module calls a hook with 3 arguments
                capacity = expert_capacity(x.shape[0], counts.numel(), factor)
                capacity = _aligned(module, capacity, mesh.size(), 1)
                return capacity_dispatch(module, x, counts, mesh, capacity)

            combine = capacity_combine
        # torch annotates the hook functions as returning None; their results replace the
        # module's inputs and outputs.
        return distribute_module(
            module,
            device_mesh,
            partition_fn=_shard_experts,
            input_fn=dispatch,  # type: ignore[arg-type]
            output_fn=combine,  # type: ignore[arg-type]
        )


def _overlap(module: nn.Module, mesh: DeviceMesh, factor: float, chunks: int) -> None:
    """Wrap `module.forward` (an instance attribute, so its parameter names do not change) in
    the overlapped capacity exchange."""
    experts = module.forward

    def forward(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        capacity = chunked_capacity(x.shape[0], counts.numel(), factor, chunks)
        capacity = _aligned(module, capacity, mesh.size(), chunks)
        return overlapped_exchange(module, experts, x, counts, mesh, capacity, chunks)

    module.forward = forward  # type: ignore[method-assign]


def _aligned(module: nn.Module, capacity: int, ep: int, chunks: int) -> int:
    """The capacity with every expert group a multiple of the module's `group_multiple` rows
    (`aligned_capacity`), so that the groups need no padding (`_apply` sets `groups_aligned`)."""
    return aligned_capacity(capacity, ep, chunks, getattr(module, "group_multiple", 1))


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), param.requires_grad)
        module.register_parameter(pname, sharded)


def _dispatch(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    x, counts = inputs
    ep, group = mesh.size(), mesh.get_group()
    local_experts = counts.numel() // ep
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [source rank][local expert]
    per_peer = recv_counts.view(ep, local_experts)
    if is_fake(counts):
        # Fake tensors (a dry run's step, the ledger) hold no counts: the exchange is priced
        # at the load a balanced router gives, every rank's slots split evenly over the ranks.
        # A GPU run reads both split lists on the host (a host sync): the ledger counts it.
        host_reads.skipped("expert_parallel.splits", recv_counts)
        send_splits = recv_splits = even_splits(x.shape[0], ep)
    else:
        send_splits = counts.view(ep, local_experts).sum(1).tolist()
        recv_splits = per_peer.sum(1).tolist()
    received = all_to_all_single_autograd(x, recv_splits, send_splits, group)
    # Segment (source s, expert e) of the received slots sorts to position e·ep + s.
    segment_key = torch.arange(ep * local_experts, device=counts.device).view(ep, local_experts)
    segment_key = (segment_key % local_experts) * ep + segment_key // local_experts
    key = torch.repeat_interleave(
        segment_key.flatten(), per_peer.flatten(), output_size=sum(recv_splits)
    )
    order = key.argsort(stable=True)
    module._ep_exchange = _Exchange(send_splits, recv_splits, order)  # type: ignore[assignment]
    return received[order], per_peer.sum(0)


def even_splits(rows: int, parts: int) -> list[int]:
    """`rows` split into `parts` sizes as equal as they can be (the first ones one larger)."""
    return [rows // parts + (i < rows % parts) for i in range(parts)]


def _combine(module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    ex: _Exchange = module._ep_exchange  # type: ignore[assignment]
    del module._ep_exchange
    back = torch.empty_like(ex.order).scatter_(
        0, ex.order, torch.arange(ex.order.numel(), device=ex.order.device)
    )
    return all_to_all_single_autograd(out[back], ex.send_splits, ex.recv_splits, mesh.get_group())


def apply_ep(
    model: nn.Module, ep_mesh: DeviceMesh, capacity_factor: float = 0.0, dispatch_chunks: int = 1
) -> None:
    """Shard the routed experts of every MoE layer of `model` (a decoder or a pipeline stage)
    over `ep_mesh` in place, with the exact exchange or, for `capacity_factor` > 0, the
    capacity-bounded one, whose dropped slots each layer's `tokens_dropped` counts, overlapped
    in `dispatch_chunks` chunks when > 1 (`ExpertParallel`). Raises ValueError when the expert
    count is not divisible by ep, or for chunks `ExpertParallel` refuses."""
    for moe in moe_layers(model):
        if moe.args.num_experts % ep_mesh.size():
            raise ValueError(
                f"num_experts={moe.args.num_experts} is not divisible by ep={ep_mesh.size()}"
            )
        if capacity_factor > 0:
            moe.experts.record_dropped = partial(_record_dropped, moe)  # type: ignore[assignment]
        parallelize_module(moe.experts, ep_mesh, ExpertParallel(capacity_factor, dispatch_chunks))


def _record_dropped(moe: MoE, dropped: torch.Tensor) -> None:
    """Add `dropped` (0-d) to `moe.tokens_dropped` in a forward that records statistics: a
    training microbatch's, not a paused forward's nor an activation checkpoint's recomputation
    in backward (`add_once`, which a compiled MoE block runs as eager code)."""
    if moe.record_stats:
        add_once(moe.tokens_dropped, dropped)
