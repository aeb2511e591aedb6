"""Attention with learned sinks and sliding windows, exact, over PyTorch's SDPA.

- **Sliding window** of W tokens (Beltagy et al. 2020, "Longformer"; Mistral 7B; gpt-oss): query
  i attends key j when 0 <= i - j < W (itself and the W - 1 tokens before it), as Hugging Face's
  `sliding_window_overlay`. When the sequence is longer than 2W the queries run in chunks of W,
  each against its own chunk and the one before (2W keys), so the work grows as S · 2W instead
  of S²: `sliding_window_attention`.
- **Attention sinks** (Xiao et al. 2023, "Efficient Streaming Language Models with Attention
  Sinks", arXiv:2309.17453; gpt-oss): a learned logit s_h per head joins each softmax
  denominator and takes no value, so p_j = exp(l_j) / (exp(s_h) + Σ_j' exp(l_j')). Computed
  exactly by one extra key per head: q gets one more coordinate 1/scale, every real key 0 there,
  and the sink key holds s_h in it and 0 elsewhere with a zero value, so its scaled logit is
  exactly s_h and its gradient reaches s_h through SDPA's own backward. (FlexAttention's
  log-sum-exp route has no CPU backward in torch 2.13.)

Every function takes q (bs, heads, seq, d) and k, v (bs, heads, kv_len, d) with the key-value
heads already repeated to the query heads, and returns (bs, heads, seq, d) in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlab.models.common.init import normal_


class AttentionSinks(nn.Module):
    """The learned sink logit of each head, `weight` (n_heads,); under tensor parallel a block
    of heads (split from outside like the head projections). Hugging Face: `self_attn.sinks`."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def init_weights(self) -> None:
        normal_(self.weight, 0.02)  # Hugging Face's GptOss initializer_range

    def forward(self) -> torch.Tensor:
        """(local heads,) sink logits."""
        return self.weight


def band_mask(seq: int, kv_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(seq, kv_len) bool, True where query i (at position kv_len - seq + i) may attend key j:
    causal, and within `window` tokens when given."""
    q = torch.arange(kv_len - seq, kv_len, device=device)[:, None]
    k = torch.arange(kv_len, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    return allowed


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA under a boolean `mask` (broadcastable to (bs, heads, seq, kv_len), True: attend),
    with the sink logits `sinks` ((heads,), any float dtype) in every softmax when given;
    `scale` of the logits, 1/√d by default."""
    d = q.shape[-1]
    scale = scale if scale is not None else d**-0.5
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    lead = q.shape[:-2]
    one = q.new_full((*q.shape[:-1], 1), 1.0 / scale)
    q = torch.cat([q, one], dim=-1)  # (.., seq, d + 1)
    k = torch.cat([k, k.new_zeros((*k.shape[:-1], 1))], dim=-1)
    heads = sinks.shape[0]
    sink_key = torch.cat([q.new_zeros(heads, d), sinks.to(q.dtype)[:, None]], dim=-1)
    sink_key = _heads_view(sink_key, len(lead)).expand(*lead, 1, d + 1)
    k = torch.cat([k, sink_key], dim=-2)  # (.., kv_len + 1, d + 1)
    v = torch.cat([v, v.new_zeros((*v.shape[:-2], 1, v.shape[-1]))], dim=-2)
    mask = torch.cat([mask, mask.new_ones((*mask.shape[:-1], 1))], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _heads_view(sink_key: torch.Tensor, lead_dims: int) -> torch.Tensor:
    """(heads, d + 1) → a view broadcasting over q's leading dims, with heads at dim 1
    ((bs, heads, seq, d) or the chunked (bs, heads, chunks, seq, d))."""
    heads, width = sink_key.shape
    shape = [1] * (lead_dims + 2)
    shape[1], shape[-1] = heads, width
    return sink_key.view(shape)


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    sinks: torch.Tensor | None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a whole sequence (seq == kv_len) within a window of `window` tokens.

    Args:
        q, k, v: (bs, heads, seq, d).
        window: W >= 1 tokens.
        sinks: (heads,) sink logits or None.
        allowed: (bs, 1, seq, seq) bool document mask (True: same document, causal) or None.
    Returns:
        (bs, heads, seq, d). Longer than 2W, queries run in chunks of W against 2W keys.
    """
    bs, heads, seq, d = q.shape
    if seq <= 2 * window:
        mask = band_mask(seq, seq, window, q.device)
        if allowed is not None:
            mask = mask & allowed
        return attend(q, k, v, mask, sinks)
    n = -(-seq // window)  # chunks of W queries
    pad_end = n * window - seq
    qc = F.pad(q, (0, 0, 0, pad_end)).view(bs, heads, n, window, d)
    # Keys of chunk i: positions (i - 1)W .. (i + 1)W - 1, the first W of chunk 0 being padding.
    kp, vp = (F.pad(t, (0, 0, window, pad_end)) for t in (k, v))
    kc = kp.unfold(2, 2 * window, window).transpose(-1, -2)  # (bs, heads, n, 2W, d)
    vc = vp.unfold(2, 2 * window, window).transpose(-1, -2)
    r = torch.arange(window, device=q.device)[:, None]  # query offset in its chunk
    c = torch.arange(2 * window, device=q.device)[None, :]  # key offset in the 2W
    band = (c > r) & (c <= r + window)  # 0 <= q - key < W
    first = torch.arange(n, device=q.device)[:, None, None] > 0
    mask = band[None] & (first | (c >= window)[None])  # (n, W, 2W): chunk 0's padding masked
    mask = mask[None, None]  # (1, 1, n, W, 2W)
    if allowed is not None:
        rows = torch.arange(n * window, device=q.device).view(n, window)
        cols = window * torch.arange(n, device=q.device)[:, None] + c  # (n, 2W), padded coords
        padded = F.pad(allowed, (window, pad_end, 0, pad_end))  # (bs, 1, nW, (n + 1)W)
        mask = mask & padded[:, :, rows[:, :, None], cols[:, None, :]]
    out = attend(qc, kc, vc, mask, sinks)  # (bs, heads, n, W, d)
    return out.reshape(bs, heads, n * window, d)[:, :, :seq]
