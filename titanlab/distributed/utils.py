"""Numerics that must agree across ranks: the global gradient norm and global sums."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    parameters: list[torch.nn.Parameter], max_norm: float, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Clip gradients in place to a global L2 norm of at most `max_norm`; return the norm.

    The norm covers every shard of every parameter: DTensor gradients (FSDP, TP) are reduced
    over their own mesh by `full_tensor()`, and under pipeline parallel the squared norms of the
    stages are summed over `pp_mesh`. `max_norm <= 0` only measures. Returns a 0-dim float32
    tensor on the gradients' device (the same value on every rank).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pp_mesh is not None:
        total = total.float() ** 2
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total = total.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total.float()


def global_sum(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Sum a tensor over `mesh` (returns a new tensor; the identity when mesh is None)."""
    out = value.detach().clone()
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return out
