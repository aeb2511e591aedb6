"""The training loss: token cross-entropy, summed, then normalized by the global token count."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titanlab.components.compiled import compile_function
from titanlab.data.labels import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "ScaledLoss", "build_loss_fn", "cross_entropy_sum", "local_value",
           "maybe_loss_parallel"]  # fmt: skip


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies in fp32.

    Args:
        logits: (bs, seq, vocab), any float dtype; a vocab-sharded DTensor under loss parallel.
        labels: (bs, seq) int64; positions equal to -100 are ignored.
    Returns:
        a 0-dim fp32 tensor (a replicated DTensor under loss parallel).
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
    )


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (replicated) DTensor loss, detached."""
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


class ScaledLoss:
    """`loss_fn` for the pipeline schedule: token-sum × `scale`, where the trainer sets `scale`
    each step to (ranks FSDP/DDP average over) / (global token count)."""

    def __init__(self, loss_fn=None) -> None:
        self.scale: float | torch.Tensor = 1.0
        self.loss_fn = loss_fn or cross_entropy_sum

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, labels) * self.scale


def build_loss_fn(compile_loss: bool, loss_parallel: bool):
    """`cross_entropy_sum`, compiled (`torch.compile`) when `compile_loss`. Under loss parallel
    it stays eager: the cross-entropy of vocab-sharded DTensor logits is dispatched by the
    `loss_parallel()` context, which a compiled graph would not see."""
    if compile_loss and not loss_parallel:
        return compile_function(cross_entropy_sum)
    return cross_entropy_sum


def maybe_loss_parallel(enabled: bool):
    """`loss_parallel()` (cross-entropy on vocab-sharded logits) when enabled, else a no-op."""
    return loss_parallel() if enabled else contextlib.nullcontext()
