"""Chunked fused linear + cross-entropy: the output projection and the token cross-entropy over
chunks of tokens, so the (tokens × vocab) logits never exist whole, in forward or in backward.

The method of Liger Kernel's FusedLinearCrossEntropy and of Wijmans et al. 2024 ("Cut Your
Losses in Large-Vocabulary Language Models", arXiv:2411.09009), in plain PyTorch: for each chunk
of c tokens the logits (c × V) are computed, their log-sum-exp and the label's logit give the
chunk's loss, and, since the loss is the last op of the step, the gradient is computed right
there: d(Σ CE)/d(logits) = softmax(logits) − onehot(label) (0 on ignored positions), then
d/d(hidden) = g W and d/d(W) += gᵀ h. Backward only scales the stored gradients by the incoming
one. Peak extra memory: one chunk's logits (c × V fp32) instead of all of them (twice: the
logits and their gradient), at the cost of nothing recomputed.

On CPU and for every dtype: the logits of a chunk are computed in the input's dtype (as the
unfused head does under autocast) and the softmax / log-sum-exp in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from titanlab.data.labels import IGNORE_INDEX


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int):  # type: ignore[override]
        n = hidden.shape[0]
        want_h = ctx.needs_input_grad[0]
        want_w = ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        )
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            h = hidden[start : start + chunk_size]  # (c, D)
            y = labels[start : start + chunk_size]  # (c,)
            logits = (h @ weight.t()).float()  # (c, V)
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            keep = y != IGNORE_INDEX
            target = y.clamp(min=0)
            picked = logits.gather(1, target[:, None])[:, 0]
            total += torch.where(keep, lse - picked, 0.0).sum()
            if want_h or want_w:
                g = torch.softmax(logits, dim=-1)  # reuses nothing: logits die with the chunk
                g.scatter_add_(1, target[:, None], torch.full_like(picked, -1.0)[:, None])
                g.mul_(keep[:, None])
                g = g.to(h.dtype)
                if want_h:
                    grad_h[start : start + chunk_size] = g @ weight
                if want_w:
                    grad_w.add_(g.t().float() @ h.float())
        ctx.save_for_backward(
            grad_h if want_h else torch.empty(0), grad_w if want_w else torch.empty(0)
        )
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        dh = grad_h * grad_out.to(grad_h.dtype) if ctx.needs_input_grad[0] else None
        dw = (grad_w * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024
) -> torch.Tensor:
    """Σ over tokens of cross_entropy(hidden @ weightᵀ, labels), without materializing the
    logits: equal to `cross_entropy_sum(F.linear(hidden, weight), labels)` (fp32 softmax).

    Args:
        hidden: (..., D) float, the final norm's output; weight: (V, D), the output head's;
        labels: (...) int64, -100 ignored; chunk_size: tokens per chunk (> 0).
    Returns:
        0-dim fp32 tensor, differentiable w.r.t. hidden and weight.
    Raises:
        ValueError: chunk_size <= 0.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropySum.apply(flat, weight, flat_labels, chunk_size)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, flat.shape[0], chunk_size):  # no gradient: the loss alone
        logits = (flat[start : start + chunk_size] @ weight.t()).float()
        total += _chunk_loss(logits, flat_labels[start : start + chunk_size])
    return total


def _chunk_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ CE of one chunk's fp32 logits (c, V) and labels (c,)."""
    keep = labels != IGNORE_INDEX
    picked = logits.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    return torch.where(keep, torch.logsumexp(logits, dim=-1) - picked, 0.0).sum()


class FusedLossHead(nn.Linear):
    """The output head of a model trained with the chunked fused loss: a bias-free Linear (its
    `weight` keeps the name, so checkpoints and exports are unchanged) that returns logits as
    usual, or, while `targets(labels)` is active, the summed cross-entropy of its input against
    `labels` computed by `linear_cross_entropy_sum` (0-dim fp32), so the model's forward ends
    in the loss and the logits never exist. Swapped in from outside by `use_fused_loss`,
    before parallelism is applied, so FSDP's hooks on the head (gather, reshard, reduce-scatter)
    run as for the plain Linear."""

    def __init__(self, in_features: int, out_features: int, chunk_size: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.chunk_size = chunk_size
        self.labels: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.labels is None:
            return F.linear(x, self.weight)
        return linear_cross_entropy_sum(x, self.weight, self.labels, self.chunk_size)


def use_fused_loss(model: nn.Module, chunk_size: int) -> None:
    """Swap `model.output` (a bias-free nn.Linear; the model on any device, meta included) for
    a `FusedLossHead` holding the same weight Parameter."""
    old = model.output
    with torch.device(old.weight.device):
        head = FusedLossHead(old.in_features, old.out_features, chunk_size)
    head.weight = old.weight
    model.output = head


@contextlib.contextmanager
def fused_targets(model: nn.Module, labels: torch.Tensor) -> Iterator[None]:
    """Within, `model(inputs)` returns the summed token cross-entropy against `labels` ((bs,
    seq) int64, -100 ignored) instead of logits."""
    head = model.output
    assert isinstance(head, FusedLossHead), "use_fused_loss(model) first"
    head.labels = labels
    try:
        yield
    finally:
        head.labels = None
