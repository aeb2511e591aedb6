"""The differentiable collectives of titanlab's own context-parallel attention
(`titanlab.distributed.context_parallel.documents`), each an autograd Function whose backward is the
transposed exchange:

- `gather_sequence`: all-gather along the sequence dim (backward: sum the gradients over the
  ranks, keep this rank's slice: a reduce-scatter);
- `sequence_to_heads` / `heads_to_sequence`: DeepSpeed-Ulysses' all-to-all (Jacobs et al.
  2023, arXiv:2309.14509) from (bs, H, S/cp, d) sequence shards to (bs, H/cp, S, d) head
  shards, and back (each the other's backward);
- `shift` (not differentiable; the ring's autograd Function calls it both ways): send this
  rank's tensor `step` ranks on and receive the one from `step` ranks back.

They run on any backend with all_gather, all_reduce, all_to_all_single and point-to-point
sends (gloo included). Bytes a rank sends per call, for a tensor of n elements of b bytes on
cp ranks: gather (cp−1)·n·b forward and as much backward; each all-to-all (cp−1)/cp·n·b;
shift n·b sent and n·b received.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(world, dim=ctx.dim)[rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All ranks' `x` concatenated along `dim` in rank order (differentiable)."""
    return _GatherSequence.apply(x, dim, group)


def gather_values(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`gather_sequence` for tensors without gradients (document ids, positions)."""
    return _gather(x, dim, group)


def _all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, group) -> torch.Tensor:
    """Split `x` into cp pieces along `split_dim`, send piece j to rank j, and concatenate the
    received pieces along `cat_dim` in rank order."""
    world = dist.get_world_size(group)
    pieces = torch.stack(list(x.chunk(world, dim=split_dim)))  # (cp, ...) piece j for rank j
    pieces = pieces.contiguous()
    out = torch.empty_like(pieces)
    dist.all_to_all_single(out, pieces, group=group)
    return torch.cat(list(out.unbind(0)), dim=cat_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, split_dim: int, cat_dim: int, group) -> torch.Tensor:
        ctx.dims, ctx.group = (split_dim, cat_dim), group
        return _all_to_all(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split_dim, cat_dim = ctx.dims
        return _all_to_all(grad, cat_dim, split_dim, ctx.group), None, None, None


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(bs, H, S/cp, d) this rank's sequence shard → (bs, H/cp, S, d) this rank's heads over
    the whole sequence (the ranks' shards in rank order). H must divide by cp."""
    return _AllToAll.apply(x, 1, 2, group)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `sequence_to_heads`: (bs, H/cp, S, d) → (bs, H, S/cp, d)."""
    return _AllToAll.apply(x, 2, 1, group)


def shift(x: torch.Tensor, step: int, group) -> torch.Tensor:
    """Send `x` to the rank `step` places on (mod cp), receive from `step` places back."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    to = dist.get_global_rank(group, (rank + step) % world)
    src = dist.get_global_rank(group, (rank - step) % world)
    x = x.contiguous()
    out = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, to, group),
        dist.P2POp(dist.irecv, out, src, group),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out
