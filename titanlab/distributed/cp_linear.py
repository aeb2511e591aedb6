"""Context parallel for linear-attention layers (Gated DeltaNet, `titanlab.models.common.
linear_attention`): each cp rank holds a contiguous piece of the sequence, and its recurrence
must start from the state the ranks before it leave.

The rule's effect on the state over a piece of the sequence is affine, M_end = T M_start + B
(`titanlab.models.common.delta_rule.sequence_transition`: T is d_k × d_k, B is d_k × d_v per
head; the same algebra as a chunk's, derived there). So each rank computes its own (T_r, B_r)
from a zero start, the ranks all-gather them, and rank r composes those of ranks 0 … r − 1:
M_start(r) = T_{r−1}(… (T_1 (T_0 · 0 + B_0) + B_1) …) + B_{r−1}, a prefix scan over cp ranks
(the scan of Blelloch 1990, "Prefix Sums and Their Applications", serial here: cp is small).
The rank then runs its piece from M_start. Backward carries the state's dependence on the
earlier ranks' keys, values and gates back to them (one all-reduce of every rank's (dT, dB):
`_Prefix`), so it trains.

Bytes a rank sends per layer and microbatch: its T and B, bs · H_v · d_k · (d_k + d_v) fp32
values, to each of the cp − 1 others (an all-gather) forward, and an all-reduce of cp of them
backward; independent of the sequence length. Contiguous pieces only (no load balancing: the recurrence's work is
linear in the tokens, equal per rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titanlab.distributed.cp_collectives import gather_values
from titanlab.models.common.delta_rule import sequence_transition


def starting_state(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, group
) -> torch.Tensor:
    """The state (bs, H_v, d_k, d_v) float32 this cp rank's piece starts from: the earlier
    ranks' transitions composed in order (module docstring). k (bs, S/cp, H_k, d_k), v
    (bs, S/cp, H_v, d_v), g and beta (bs, S/cp, H_v) are this rank's."""
    t, b = sequence_transition(k, v, g, beta)
    return _Prefix.apply(t, b, group)


class _Prefix(torch.autograd.Function):
    """Forward: all-gather every rank's (T, B) and compose those before this rank. Backward:
    each rank differentiates its own composition with respect to every earlier (T_r, B_r)
    (state_{r+1} = T_r state_r + B_r: dB_r = d state_{r+1}, dT_r = d state_{r+1} state_rᵀ,
    d state_r = T_rᵀ d state_{r+1}), and one all-reduce sums what all ranks found for each
    rank's (T, B), so every rank takes part whatever its place (rank 0 depends on no one)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, b: torch.Tensor, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ts = gather_values(t[None], 0, group)  # (cp, bs, H_v, d_k, d_k)
        bs = gather_values(b[None], 0, group)
        states = [torch.zeros_like(b)]
        for r in range(rank):
            states.append(ts[r] @ states[-1] + bs[r])
        ctx.save_for_backward(ts, *states)
        ctx.group, ctx.world, ctx.rank = group, world, rank
        return states[-1]

    @staticmethod
    def backward(ctx, d_state: torch.Tensor):
        ts, *states = ctx.saved_tensors
        d_t = torch.zeros_like(ts)
        d_b = torch.zeros((ctx.world, *d_state.shape), dtype=d_state.dtype, device=d_state.device)
        for r in reversed(range(ctx.rank)):
            d_b[r] = d_state
            d_t[r] = d_state @ states[r].transpose(-1, -2)
            d_state = ts[r].transpose(-1, -2) @ d_state
        both = torch.cat([d_t.flatten(1), d_b.flatten(1)], dim=1)
        dist.all_reduce(both, group=ctx.group)
        mine = both[ctx.rank]
        split = d_t[0].numel()
        return mine[:split].view_as(d_t[0]), mine[split:].view_as(d_b[0]), None
