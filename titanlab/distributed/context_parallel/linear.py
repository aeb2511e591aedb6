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

**The trainer's pieces** (`SequenceCarry`). Under context parallel a rank holds the tokens
its load balancer chose (head-tail, `work`), not a contiguous piece, while the attention layers
stay balanced. So a linear layer moves its projected inputs to contiguous pieces (rank r:
tokens r·S/cp … (r+1)·S/cp − 1), runs there, and moves its output back: each an all-gather
along the sequence whose backward is a reduce-scatter (`collectives.gather_sequence`), then
a gather by the tokens' positions (the index in the window: document masks, where positions
restart, are refused for these layers). The causal convolution's first K − 1 outputs need the
previous piece's last K − 1 inputs: an all-gather of every rank's last K − 1 rows.

Bytes a rank sends per linear layer and microbatch (bs sequences, b bytes per value, C the
convolution's channels, tp ranks splitting the heads), each to the cp − 1 others: forward,
its projected inputs bs · S/cp · (C + 2 H_v) / tp · b and its output bs · S/cp · H_v · d_v / tp
· b (the gathers), the convolution's halo bs · (K − 1) · C / tp · b, and T and B,
bs · H_v / tp · d_k · (d_k + d_v) fp32 values, independent of the sequence length; backward,
the same again (reduce-scatters, the all-reduce of (dT, dB)).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titanlab.distributed.context_parallel.collectives import gather_sequence, gather_values
from titanlab.models.common.delta_rule import sequence_transition


class SequenceCarry:
    """What a Gated DeltaNet layer (`GatedDeltaNet.step(..., carry=)`) asks of context parallel
    (module docstring, "The trainer's pieces"): built once per forward by
    `documents.ContextParallelAttention` from this rank's and all ranks' token positions
    (bs, S/cp) and (bs, S) int64, the latter in rank order.

    Every method is a collective of the cp group, called in the same order on every rank."""

    def __init__(self, mine: torch.Tensor, all_positions: torch.Tensor, group) -> None:
        self.mine, self.group = mine, group
        self.order = all_positions.argsort(dim=1)  # (bs, S): gathered index of each position
        self.rank = dist.get_rank(group)

    @torch.compiler.disable
    def to_contiguous(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Tensors (bs, S/cp, ·) of this rank's tokens → the same of this rank's contiguous
        piece, in sequence order (differentiable)."""
        widths = [t.shape[-1] for t in tensors]
        both = torch.cat(tensors, dim=-1)
        gathered = gather_sequence(both, 1, self.group)  # (bs, S, ·) in rank order
        ordered = gathered.gather(1, self.order[..., None].expand(-1, -1, both.shape[-1]))
        n = both.shape[1]
        piece = ordered[:, self.rank * n : (self.rank + 1) * n]
        return list(piece.split(widths, dim=-1))

    @torch.compiler.disable
    def from_contiguous(self, x: torch.Tensor) -> torch.Tensor:
        """(bs, S/cp, ...) of this rank's contiguous piece → the same of its own tokens."""
        whole = gather_sequence(x, 1, self.group)  # (bs, S, ...) in sequence order
        index = self.mine.view(*self.mine.shape, *([1] * (x.dim() - 2)))
        return whole.gather(1, index.expand(-1, -1, *x.shape[2:]))

    @torch.compiler.disable
    def history(self, mixed: torch.Tensor, taps: int) -> torch.Tensor:
        """The K − 1 = `taps` − 1 projected inputs (bs, K − 1, C) before this rank's piece (the
        previous rank's last ones; zeros on rank 0), for the causal convolution."""
        tail = mixed[:, mixed.shape[1] - (taps - 1) :]
        tails = gather_sequence(tail, 1, self.group)  # (bs, cp · (K − 1), C)
        # Rank 0 reads the zeros in front: its result still comes from the gather, so its
        # backward joins the gather's reduce-scatter like every other rank's.
        padded = torch.cat([torch.zeros_like(tail), tails], dim=1)
        return padded[:, self.rank * (taps - 1) : (self.rank + 1) * (taps - 1)]

    @torch.compiler.disable
    def initial_state(self, k, v, g, beta) -> torch.Tensor:
        """The delta rule's state this rank's piece starts from (`starting_state`)."""
        return starting_state(k, v, g, beta, self.group)


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
