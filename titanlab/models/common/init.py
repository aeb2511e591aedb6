"""Weight initialisation helpers shared by the families."""

from __future__ import annotations

import torch
from torch import nn


def trunc_normal_(w: torch.Tensor, std: float, cutoff: float = 3.0) -> None:
    """Truncated normal init at +-cutoff*std (realised std ~0.986*std for cutoff 3)."""
    nn.init.trunc_normal_(w, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)
