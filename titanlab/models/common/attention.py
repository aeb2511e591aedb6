"""Causal grouped-query self-attention (Ainslie et al. 2023, "GQA") over PyTorch's SDPA."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from titanlab.models.common import flex_kernel
from titanlab.models.common.init import trunc_normal_
from titanlab.models.common.kv_cache import LayerCache
from titanlab.models.common.local_attention import (
    AttentionSinks,
    attend,
    band_mask,
    sliding_window_attention,
)
from titanlab.models.common.logit_max import max_logits
from titanlab.models.common.rope import apply_rotary_emb


class Attention(nn.Module):
    """GQA with RoPE; optionally RMSNorm on each q and k head before RoPE (Qwen3), biases on the
    four projections, learned attention sinks and a sliding window (gpt-oss;
    `titanlab.models.common.local_attention`).

    Args:
        dim: model width; n_heads / kv_heads: query / key-value heads (kv_heads divides n_heads);
        head_dim: width of one head (even, for RoPE), not necessarily dim // n_heads;
        qk_norm_eps: None for no q/k norm (Llama), else the eps of the per-head RMSNorms
            `q_norm` / `k_norm` over head_dim (Qwen3: Yang et al. 2025, "Qwen3 Technical Report").
        bias: wq, wk, wv and wo carry biases (gpt-oss, Qwen2).
        sinks: one learned sink logit per head in every softmax (`sinks.weight`, (n_heads,)).
        window: attend only the last `window` tokens (itself included); None: all before.
        output_gate: wq also gives each head a gate (its rows: the head's query, then its gate)
            and the attention output is multiplied by σ(gate) before wo (Qwen3.5's gated
            attention: Qiu et al. 2025, "Gated Attention for Large Language Models",
            arXiv:2505.06708).
        rotary_dim: RoPE on the first `rotary_dim` dims of each q and k head (the cos and sin
            tables then (·, rotary_dim // 2)); None: all of head_dim.
        norm_class: the q/k norms' class, called (head_dim, eps=qk_norm_eps): `nn.RMSNorm`, or
            `norms.ZeroCenteredRMSNorm` (Qwen3.5).

    With `record_max_logit` set, each training forward keeps the largest pre-softmax logit of
    each (local) head so far in `max_logit` ((heads,) float32; `titanlab.distributed.qk_clip`
    reads and clears it).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        kv_heads: int,
        head_dim: int,
        qk_norm_eps: float | None,
        *,
        bias: bool = False,
        sinks: bool = False,
        window: int | None = None,
        output_gate: bool = False,
        rotary_dim: int | None = None,
        norm_class: type[nn.Module] = nn.RMSNorm,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.output_gate = output_gate
        self.rotary_dim = rotary_dim if rotary_dim is not None else head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim * (2 if output_gate else 1), bias=bias)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.sinks = AttentionSinks(n_heads) if sinks else None
        self.window = window
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm_eps is not None:
            self.q_norm = norm_class(head_dim, eps=qk_norm_eps)
            self.k_norm = norm_class(head_dim, eps=qk_norm_eps)
        self.record_max_logit = False
        self.max_logit: torch.Tensor | None = None

    def init_weights(self, out_std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            trunc_normal_(w.weight, 0.02)
        trunc_normal_(self.wo.weight, out_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if self.sinks is not None:
            self.sinks.init_weights()
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()  # type: ignore[operator]

    def forward(
        self,
        x_bsd: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: LayerCache | None = None,
        mask: Any = None,
    ) -> torch.Tensor:
        """x_bsd: (bs, seq, dim); cos, sin: (>= seq, head_dim // 2), sliced here to seq.
        Returns (bs, seq, dim).

        With `kv` (generation only): cos and sin are (bs, seq, head_dim // 2), each sequence's
        own positions; the new keys and values join the cache and attention runs over all cached
        slots under its mask.

        Head counts come from the projections' sizes (-1), so under tensor parallelism the module
        runs on the local heads. The RoPE tables are sliced here, to the length attention really
        sees (under sequence parallel the block's input holds only a slice of the sequence).

        With `mask` (document masking, training): cos and sin are (bs, seq, head_dim // 2), each
        token's own position, and `mask` is a (bs, 1, seq, seq) bool SDPA mask or a
        FlexAttention `BlockMask` (`titanlab.models.common.document_mask.attention_masks`: on
        CUDA, also for windows and sinks without documents) replacing the causal mask, or an
        object whose `attend(q, k, v, window=, sinks=)` computes the attention (context
        parallel's, `document_mask.mask_builder`).
        """
        bs, seq, _ = x_bsd.shape
        gate = None
        if self.output_gate:  # each head's rows: its query, then its gate (Qwen3.5's layout)
            q, gate = self.wq(x_bsd).view(bs, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = self.wq(x_bsd).view(bs, seq, -1, self.head_dim)  # (bs, seq, heads, head_dim)
        k = self.wk(x_bsd).view(bs, seq, -1, self.head_dim)  # (bs, seq, kv_heads, head_dim)
        v = self.wv(x_bsd).view(bs, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if kv is None and cos.dim() != 3:  # one table for all rows: slice it to the sequence
            cos, sin = cos[:seq], sin[:seq]
        q, k = self._rotated(q, k, cos, sin)
        if kv is not None:
            # (bs, kv_len, kv_heads, head_dim), (bs, 1, seq, kv_len); a sliding layer's cache
            # holds its last `window` slots only, the mask saying which it may see.
            k, v, mask = kv.update(k, v, self.window)
        n_rep = q.shape[2] // k.shape[2]
        if n_rep > 1:  # kv head j serves q heads j*n_rep .. (j+1)*n_rep-1 (repeat_interleave)
            k = k[:, :, :, None, :].expand(-1, -1, -1, n_rep, -1).flatten(2, 3)
            v = v[:, :, :, None, :].expand(-1, -1, -1, n_rep, -1).flatten(2, 3)
        if self.record_max_logit and kv is None:
            m = max_logits(q.transpose(1, 2), k.transpose(1, 2), mask)
            self.max_logit = m if self.max_logit is None else torch.maximum(self.max_logit, m)
        sinks = self.sinks() if self.sinks is not None else None
        if hasattr(mask, "attend"):  # an attention built outside (context parallel's)
            out = mask.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              window=self.window, sinks=sinks)  # fmt: skip
        elif isinstance(mask, BlockMask):  # CUDA: documents, windows, sinks (block-sparse)
            out = flex_kernel.flex_attend(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                sinks=sinks, window=self.window,
            )  # fmt: skip
        elif sinks is not None or self.window is not None:
            out = self._local(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, kv)
        elif mask is None:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )  # (bs, heads, seq, head_dim)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
            )
        out = out.transpose(1, 2).reshape(bs, seq, -1)
        if gate is not None:  # gated attention (Qiu et al. 2025, arXiv:2505.06708): σ(gate)
            out = out * torch.sigmoid(gate.reshape(bs, seq, -1))
        return self.wo(out)

    def _rotated(self, q, k, cos, sin):
        """RoPE on the first `rotary_dim` dims of each q and k head (all of them by default;
        Qwen3.5 rotates a quarter), the rest passed through."""
        if self.rotary_dim == self.head_dim:
            return apply_rotary_emb(q, k, cos, sin)
        r = self.rotary_dim
        q_rot, k_rot = apply_rotary_emb(q[..., :r], k[..., :r], cos, sin)
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)

    def _local(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        kv: LayerCache | None,
    ) -> torch.Tensor:
        """Sinks and/or a sliding window over (bs, heads, seq, d); `mask` a dense bool mask
        (the document mask, or the cache's, which already holds the window) or None."""
        sinks = self.sinks() if self.sinks is not None else None
        if kv is None and self.window is not None:
            return sliding_window_attention(q, k, v, self.window, sinks, mask)
        if mask is None:
            mask = band_mask(q.shape[2], k.shape[2], None, q.device)
        return attend(q, k, v, mask, sinks)
