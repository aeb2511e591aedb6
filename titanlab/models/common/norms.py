"""RMSNorm with its scale stored as an offset from one (Qwen3-Next and Qwen3.5's
`RMSNormZeroCentered`): y = x / √(mean(x²) + eps) · (1 + w), statistics and product in fp32, w
starting at zeros. The same function as `nn.RMSNorm` with weight 1 + w; stored this way, weight
decay pulls the scale towards one rather than zero."""

from __future__ import annotations

import torch
from torch import nn


class ZeroCenteredRMSNorm(nn.Module):
    """x (..., dim) → (..., dim) in x's dtype; `weight` (dim,) the offset w."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
