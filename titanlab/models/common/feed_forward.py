"""SwiGLU feed-forward block (Shazeer 2020, "GLU Variants Improve Transformer")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlab.models.common.init import trunc_normal_


class FeedForward(nn.Module):
    """w2(silu(w1 x) * w3 x), no biases; w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        trunc_normal_(self.w1.weight, 0.02)
        for w in (self.w2, self.w3):
            trunc_normal_(w.weight, out_std)

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        """(bs, seq, dim) -> (bs, seq, dim)."""
        return self.w2(F.silu(self.w1(x_bsd)) * self.w3(x_bsd))
