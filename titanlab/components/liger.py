"""Liger Kernel's Triton kernels in titanlab's modules (`kernels.liger`; Hsu et al. 2024,
"Liger Kernel: Efficient Triton Kernels for LLM Training", arXiv:2410.10989).

Applied from outside, before parallelism, like the fused loss's head: each `nn.RMSNorm` of the
model becomes a `LigerRMSNorm` and each `FeedForward` a `LigerFeedForward` by a class swap, so
parameters, their names and checkpoints are unchanged and only `forward` differs:

- RMSNorm: Liger's `LigerRMSNormFunction` in its "llama" casting mode (the mean square in fp32,
  the normalized input cast back before the weight), not in place;
- SwiGLU: `LigerSiLUMulFunction`, silu(w1 x) · (w3 x) in one kernel;
- the fused loss's head (`titanlab.components.fused_head.FusedLossHead`, with
  `loss.fused_linear_cross_entropy`): Liger's `LigerFusedLinearCrossEntropyLoss` (sum over
  tokens, -100 ignored) for the cross-entropy; distillation and the RL log-probabilities keep
  titanlab's chunked kernels.

RoPE is not swapped: Liger's kernel rotates the two halves of each head (Hugging Face's layout),
titanlab the interleaved pairs, and permuting q and k around it costs what the kernel saves.
liger-kernel is an optional dependency (`pip install 'titanlab[liger]'`), used only on CUDA.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from titanlab.config.errors import ConfigError
from titanlab.models.common.feed_forward import FeedForward


def check_liger(enabled: bool, device: torch.device) -> None:
    """Before launch: with `enabled`, the package must be importable and `device` a CUDA one.

    Raises:
        ConfigError: one line naming what is missing.
    """
    if not enabled:
        return
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(
            "kernels.liger=true needs the liger-kernel package, which is not installed; "
            "pip install 'titanlab[liger]' or set kernels.liger=false"
        )
    if device.type != "cuda":
        raise ConfigError(
            f"kernels.liger=true needs a CUDA GPU (Liger's kernels are Triton), not "
            f"{device.type}; set kernels.liger=false"
        )


class LigerRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` computed by Liger's kernel. Shapes: (..., dim) → (..., dim), input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from liger_kernel.ops import LigerRMSNormFunction

        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return LigerRMSNormFunction.apply(x, self.weight, eps, 0.0, "llama", False)


class LigerFeedForward(FeedForward):
    """`FeedForward` with Liger's fused silu(gate) · up. Shapes: (bs, seq, dim) → same."""

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        from liger_kernel.ops import LigerSiLUMulFunction

        return self.w2(LigerSiLUMulFunction.apply(self.w1(x_bsd), self.w3(x_bsd)))


def liger_linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Σ over tokens of cross_entropy(hidden @ weightᵀ, labels) by Liger's fused kernel.

    Args:
        hidden: (..., D); weight: (V, D); labels: (...) int64, -100 ignored.
    Returns:
        0-dim tensor (fp32 accumulation in Liger).
    """
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="sum")
    return loss(weight, hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1))


def apply_liger(model: nn.Module) -> int:
    """Swap `model`'s RMSNorms and SwiGLU feed-forwards for their Liger versions (class swaps:
    parameters untouched) and mark a fused-loss head to use Liger's loss. Returns the number
    of modules swapped."""
    swapped = 0
    for module in model.modules():
        if type(module) is nn.RMSNorm:
            module.__class__ = LigerRMSNorm
        elif type(module) is FeedForward:
            module.__class__ = LigerFeedForward
        elif getattr(module, "returns_loss", False):  # the fused loss's head (`fused_ce`)
            module.liger = True  # type: ignore[assignment]
        else:
            continue
        swapped += 1
    return swapped
