"""Expert parallel's capacity-bounded exchange: static shapes, no host sync, dropped slots counted.

The exact exchange (`titanlab.distributed.expert_parallel`) sends each peer the slots its
experts were given, so the split sizes depend on the routing: a GPU run reads them on the host
before the all-to-all, a sync per MoE layer and direction that stalls the CPU's kernel queue.
With a capacity factor c (`parallelism.expert_capacity_factor` > 0) each expert takes at most

    C = ceil(c · S / E)

of a rank's S = tokens · top_k slots (GShard's expert capacity, Lepikhin et al. 2020, section
2.2; Switch Transformer's capacity factor, Fedus et al. 2021, section 2.2). Every rank then
sends every peer exactly (E / ep) · C rows, the slots of each of the peer's experts in slot
order, padded with zero rows: the all-to-all has equal, static splits and the experts run on
(E / ep) groups of ep · C rows, so nothing is read on the host and the step's shapes do not
change from one batch to the next (one compiled graph). A slot past its expert's capacity is
dropped: its output is 0 (the token keeps its other experts' and the shared expert's), and it
is counted (the MoE layer's `tokens_dropped`, summed over the ranks by
`titanlab.distributed.moe_stats`).
With c ≥ E / top_k no slot can ever be dropped (one expert takes at most every token once),
and the layer equals the exact exchange.

Every ep rank must hold the same number of slots, as a training step's ranks do (local batch ×
seq_len tokens, or a pipeline microbatch's): C, and so the exchange's split sizes, come from the
rank's own count.

The zero padding rows pass through the experts (SwiGLU of 0 is 0; gpt-oss's biased experts give
them a constant) and are left out when the outputs come back, so they receive no gradient.

Overlapped in chunks (`parallelism.expert_dispatch_chunks` = k > 1, `overlapped_exchange`): the
C slot positions of every expert are cut into k runs of C / k (C rounded up to a multiple of
k), and each run is exchanged, computed and sent back on its own. Every chunk's dispatch is
issued first, so while the experts run chunk j the all-to-alls of chunk j + 1 (dispatch) and
j − 1 (combine) are on the wire; only the first dispatch and the last combine wait alone. This
is Tutel's pipelined all-to-all / expert overlap (Hwang et al. 2023, "Tutel: Adaptive
Mixture-of-Experts at Scale", section 3.3, the a2a_ffn_overlap_degree). The rows each expert
computes are the same as without chunks (each row's output is computed alone), only grouped
into k GEMMs of ep · C / k rows each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh


def expert_capacity(slots: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor · slots / num_experts): the slots of one rank an expert takes.
    Raises ValueError for a capacity factor that is not > 0."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0")
    return max(1, math.ceil(capacity_factor * slots / num_experts))


@dataclass
class _CapacityExchange:
    """How one forward's slots were placed, kept for the combine."""

    dest: torch.Tensor
    """(slots,) int64: each slot's row in the (E · C + 1)-row send buffer; row E · C holds the
    dropped slots."""
    capacity: int
    """C, the slots of this rank each expert takes."""


def place_slots(
    counts: torch.Tensor, slots: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For `slots` slots sorted by expert, `counts` (E,) int64 of them per expert: (dest
    (slots,) int64, the row e · C + i for the i-th slot of expert e, or E · C when i ≥ C;
    dropped, a 0-d int64 count of the slots past their expert's capacity). Static shapes, no
    host read (`slots` is the caller's tensor size)."""
    experts = counts.numel()
    expert_of = torch.repeat_interleave(
        torch.arange(experts, device=counts.device), counts, output_size=slots
    )
    starts = counts.cumsum(0) - counts
    position = torch.arange(slots, device=counts.device) - starts[expert_of]
    kept = position < capacity
    dest = torch.where(kept, expert_of * capacity + position, experts * capacity)
    dropped = (counts - capacity).clamp(min=0).sum()
    return dest, dropped


def capacity_dispatch(
    module: nn.Module, x: torch.Tensor, counts: torch.Tensor, mesh: DeviceMesh, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (slots, dim) sorted by expert, counts (E,) int64: the rows this rank's experts run,
    (E/ep · ep · C, dim) grouped by local expert then source rank, and the group sizes (E/ep,)
    int64 (ep · C each). Keeps the placement on `module` for `capacity_combine` and hands the
    count of dropped slots to `module.record_dropped`."""
    ep, group = mesh.size(), mesh.get_group()
    experts, dim = counts.numel(), x.shape[-1]
    local = experts // ep
    dest, dropped = place_slots(counts, x.shape[0], capacity)
    module.record_dropped(dropped)  # type: ignore[operator]  # apply_ep's callable
    rows = experts * capacity
    send = x.new_zeros(rows + 1, dim).index_copy(0, dest, x)[:rows]
    split = [local * capacity] * ep
    received = all_to_all_single_autograd(send, split, split, group)
    # [source rank][local expert][slot] -> [local expert][source rank][slot]
    grouped = received.view(ep, local, capacity, dim).transpose(0, 1).reshape(-1, dim)
    module._ep_exchange = _CapacityExchange(dest, capacity)  # type: ignore[assignment]
    sizes = torch.full((local,), ep * capacity, dtype=counts.dtype, device=counts.device)
    return grouped, sizes


def capacity_combine(module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The experts' output rows (E/ep · ep · C, dim) back to the ranks and slots they came
    from: (slots, dim) in the dispatch's slot order, 0 for a dropped slot."""
    ex: _CapacityExchange = module._ep_exchange  # type: ignore[assignment]
    del module._ep_exchange
    ep, dim = mesh.size(), out.shape[-1]
    local = out.shape[0] // (ep * ex.capacity)
    by_source = out.view(local, ep, ex.capacity, dim).transpose(0, 1).reshape(-1, dim)
    split = [local * ex.capacity] * ep
    back = all_to_all_single_autograd(by_source, split, split, mesh.get_group())
    return torch.cat([back, back.new_zeros(1, dim)])[ex.dest]


def chunked_capacity(slots: int, num_experts: int, capacity_factor: float, chunks: int) -> int:
    """`expert_capacity` rounded up to a multiple of `chunks` (>= 1): the capacity of the
    exchange overlapped in `chunks` runs of slot positions."""
    capacity = expert_capacity(slots, num_experts, capacity_factor)
    return -(-capacity // chunks) * chunks


def aligned_capacity(capacity: int, ep: int, chunks: int, multiple: int) -> int:
    """C (a multiple of `chunks`) rounded up so that every expert's group of rows in one chunk,
    ep · C / chunks, is a multiple of `multiple` (the experts' `group_multiple`: 16 for float8's
    grouped GEMM), so that the experts need not pad their groups; C itself when `multiple` is 1."""
    step = chunks * multiple // math.gcd(multiple, ep)
    return -(-capacity // step) * step


def chunk_major(dest: torch.Tensor, experts: int, capacity: int, chunks: int) -> torch.Tensor:
    """`place_slots`'s rows e · C + i (or E · C, dropped) renumbered chunk-major: the i-th slot
    of expert e goes to row j · E · c + e · c + (i − j · c), c = C / chunks, j = i // c, so each
    chunk's send rows are one contiguous (E · c)-row block in peer, then expert order."""
    per = capacity // chunks
    kept = dest < experts * capacity
    expert, position = dest // capacity, dest % capacity
    row = (position // per) * experts * per + expert * per + position % per
    return torch.where(kept, row, dest)


def overlapped_exchange(
    module: nn.Module,
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    counts: torch.Tensor,
    mesh: DeviceMesh,
    capacity: int,
    chunks: int,
) -> torch.Tensor:
    """The capacity-bounded exchange around the experts' `forward`, overlapped in `chunks` runs
    (the module docstring). x (slots, dim) sorted by expert, counts (E,) int64; `capacity` a
    multiple of `chunks` (`chunked_capacity`). Returns (slots, dim) in x's order, 0 for a
    dropped slot, and hands the count of dropped slots to `module.record_dropped`. Static
    shapes, no host read."""
    ep, group = mesh.size(), mesh.get_group()
    experts, dim = counts.numel(), x.shape[-1]
    local, per = experts // ep, capacity // chunks
    dest, dropped = place_slots(counts, x.shape[0], capacity)
    module.record_dropped(dropped)  # type: ignore[operator]  # apply_ep's callable
    dest = chunk_major(dest, experts, capacity, chunks)
    rows = experts * capacity
    send = x.new_zeros(rows + 1, dim).index_copy(0, dest, x)[:rows].view(chunks, -1, dim)
    split = [local * per] * ep
    # every dispatch first: chunk j + 1's runs beside chunk j's experts
    received = [all_to_all_single_autograd(send[j], split, split, group) for j in range(chunks)]
    sizes = torch.full((local,), ep * per, dtype=counts.dtype, device=counts.device)
    back = []
    for chunk in received:
        # [source rank][local expert][slot] -> [local expert][source rank][slot] and back
        grouped = chunk.view(ep, local, per, dim).transpose(0, 1).reshape(-1, dim)
        out = forward(grouped, sizes).view(local, ep, per, dim).transpose(0, 1).reshape(-1, dim)
        back.append(all_to_all_single_autograd(out, split, split, group))
    return torch.cat([*back, back[0].new_zeros(1, dim)])[dest]
