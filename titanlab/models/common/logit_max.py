"""The largest pre-softmax attention logit per head, the statistic MuonClip's QK-clip reads
(Kimi K2, Moonshot AI 2025, arXiv:2507.20534, §2.1)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask

CHUNK_ELEMENTS = 1 << 24
"""Scores computed at once (bs × heads × query rows × keys), bounding the extra memory."""


@torch.no_grad()
def max_logits(
    q: torch.Tensor, k: torch.Tensor, mask: Any = None, scale: float | None = None
) -> torch.Tensor:
    """max over batch, queries and allowed keys of q·kᵀ·scale (default 1/√head_dim, SDPA's),
    per head.

    q: (bs, heads, seq, head_dim); k: (bs, heads, kv_len, head_dim) (kv heads already repeated
    to the query heads); mask: None for causal, a (bs, 1, seq, kv_len) bool SDPA mask (True:
    attend) or a FlexAttention `BlockMask` of `titanlab.models.common.flex_masks` (its mask_mod
    evaluated on each chunk's rows, broadcasting: no seq × kv_len mask). Returns (heads,)
    float32. Costs one more q·kᵀ
    (2·bs·heads·seq·kv_len·head_dim FLOPs), computed in query chunks of `CHUNK_ELEMENTS`
    scores."""
    bs, heads, seq, head_dim = q.shape
    kv_len = k.shape[2]
    out = torch.full((heads,), float("-inf"), device=q.device)
    rows = max(1, CHUNK_ELEMENTS // max(bs * heads * kv_len, 1))
    cols = torch.arange(kv_len, device=q.device)
    for start in range(0, seq, rows):
        stop = min(start + rows, seq)
        scores = (q[:, :, start:stop].float() @ k.float().transpose(-1, -2)) * (
            scale if scale is not None else head_dim**-0.5
        )
        rows_idx = torch.arange(start, stop, device=q.device)
        if mask is None:  # causal: query i sees keys 0..i
            allowed = cols[None, :] <= rows_idx[:, None]
        elif isinstance(mask, BlockMask):  # titanlab's mask_mods broadcast: this chunk's rows
            batch = torch.arange(bs, device=q.device)[:, None, None]
            head = torch.zeros((), dtype=torch.long, device=q.device)  # masks ignore heads
            allowed = mask.mask_mod(batch, head, rows_idx[None, :, None], cols[None, None, :])
            allowed = allowed.expand(bs, stop - start, kv_len)[:, None]
        else:
            allowed = mask[:, :, start:stop]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.maximum(out, scores.amax(dim=(0, 2, 3)))
    return out
