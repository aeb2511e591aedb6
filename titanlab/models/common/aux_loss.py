"""Sending an auxiliary loss into backward through a tensor the forward returns anyway.

The MoE load-balance loss and the multi-token prediction loss are computed inside the model's
forward, but the trainer backpropagates only the main loss. `add_loss_grad(out, loss, scale)`
returns `out` unchanged; in backward it also sends `scale` · d(loss)/d(loss's inputs), which
equals backpropagating main + scale · loss, without the trainer knowing the loss exists (so it
works unchanged on a pipeline stage that does not hold the main loss).
"""

from __future__ import annotations

from typing import Any

import torch


class _AddLossGrad(torch.autograd.Function):
    """Identity on `out`; in backward, also d(loss)/d(loss's inputs) · `scale`."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor, scale: Any) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors
        scale = torch.as_tensor(ctx.scale, dtype=loss.dtype, device=loss.device)
        # ones_like keeps a DTensor loss (multi-token prediction under loss parallel) a DTensor
        return grad_out, torch.ones_like(loss) * scale, None


def add_loss_grad(out: torch.Tensor, loss: torch.Tensor, scale: Any) -> torch.Tensor:
    """`out` unchanged; its backward also sends `scale` · d(`loss`) (0-dim `loss`; `scale` a
    float or a 0-dim tensor, e.g. the trainer's loss scale)."""
    return _AddLossGrad.apply(out, loss, scale)
