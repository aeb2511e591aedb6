"""Multi-head latent attention (MLA; DeepSeek-AI 2024, "DeepSeek-V2", arXiv:2405.04434, §2.1),
as DeepSeek-V3 (arXiv:2412.19437, §2.1.1) and Hugging Face's `DeepseekV3Attention` compute it.

Per token x (dim):
- query: `q = wq(x)`, or with a low-rank query (q_lora_rank > 0) `q = wq_b(q_a_norm(wq_a(x)))`;
  each head is `[q_nope (qk_nope_head_dim) ; q_rope (qk_rope_head_dim)]`;
- joint key-value compression: `wkv_a(x) = [c_kv (kv_lora_rank) ; k_rope (qk_rope_head_dim)]`,
  `c_kv` RMS-normed (`kv_a_norm`); `k_rope` is one head shared by all heads (not normed);
- RoPE rotates only q_rope and k_rope (titanlab's interleaved pairs, which is DeepSeek's
  `rope_interleave` layout: Hugging Face's weights need no reordering);
- `wkv_b(c_kv)` expands every head's `[k_nope (qk_nope_head_dim) ; v (v_head_dim)]`;
- attention over `K = [k_nope ; k_rope]`, `V = v` with softmax scale `softmax_scale`
  (qk_head_dim ** -0.5, times YaRN's mscale² when the RoPE is YaRN-scaled), then `wo`.

A generation cache holds the compressed `c_kv` and the rotated `k_rope`, kv_lora_rank +
qk_rope_head_dim values per token and layer, instead of the expanded keys and values
(n_heads × (qk_head_dim + v_head_dim)). The latents are expanded through `wkv_b` at every step
(the "naive" form, Hugging Face's), not absorbed into the query.

Like `Attention`, the number of heads comes from the projections' sizes, so a tensor-parallel
plan that splits wq / wq_b and wkv_b by output rows (heads) and wo by input columns runs this
module on the local heads, with wq_a / wkv_a and the latent norms replicated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from titanlab.models.common import flex_kernel
from titanlab.models.common.init import trunc_normal_
from titanlab.models.common.logit_max import max_logits
from titanlab.models.common.kv_cache import LayerCache
from titanlab.models.common.rope import apply_rotary_emb

LATENT_NORM_EPS = 1e-6
"""eps of `q_a_norm` and `kv_a_norm`: transformers builds the two latent RMSNorms with its
default 1e-6 whatever the config's rms_norm_eps (Moonlight: 1e-5 elsewhere)."""


class MLAttention(nn.Module):
    """Causal multi-head latent attention over PyTorch's SDPA (or flex attention with a document
    `BlockMask`). No biases.

    Args:
        dim: model width.
        n_heads: attention heads (H).
        q_lora_rank: width of the compressed query (0: a full-rank `wq`).
        kv_lora_rank: width of the compressed key-value latent `c_kv`.
        qk_nope_head_dim / qk_rope_head_dim: the non-rotary / rotary widths of one query-key head
            (qk_rope_head_dim even; the RoPE tables are built for it).
        v_head_dim: width of one value head.
        softmax_scale: multiplier on q·k before the softmax.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float,
    ):
        super().__init__()
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.kv_lora_rank, self.v_head_dim = kv_lora_rank, v_head_dim
        self.softmax_scale = softmax_scale
        self.record_max_logit = False  # as `Attention`'s (titanlab.distributed.qk_clip)
        self.max_logit: torch.Tensor | None = None
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_a_norm: nn.RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if q_lora_rank > 0:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        """Input projections truncated normal std 0.02, `wo` std `out_std`, norms ones (the
        recipe of `Attention.init_weights`)."""
        for w in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if w is not None:
                trunc_normal_(w.weight, 0.02)
        trunc_normal_(self.wo.weight, out_std)
        for norm in (self.q_a_norm, self.kv_a_norm):
            if norm is not None:
                norm.reset_parameters()

    def _query(self, x_bsd: torch.Tensor) -> torch.Tensor:
        if self.wq is not None:
            return self.wq(x_bsd)
        assert self.wq_a is not None and self.q_a_norm is not None and self.wq_b is not None
        return self.wq_b(self.q_a_norm(self.wq_a(x_bsd)))

    def forward(
        self,
        x_bsd: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: LayerCache | None = None,
        mask: Any = None,
    ) -> torch.Tensor:
        """x_bsd: (bs, seq, dim); cos, sin: (>= seq, qk_rope_head_dim // 2), sliced here to seq.
        Returns (bs, seq, dim) in x's dtype.

        With `kv` (generation only): cos and sin are (bs, seq, qk_rope_head_dim // 2); this
        forward's `c_kv` (bs, seq, 1, kv_lora_rank) and rotated `k_rope` (bs, seq, 1,
        qk_rope_head_dim) join the cache, and attention runs over every cached slot under the
        cache's mask. With `mask` (document masking): cos and sin are per token (bs, seq, ·) and
        `mask` is a (bs, 1, seq, seq) bool SDPA mask or a flex attention `BlockMask`.
        """
        bs, seq, _ = x_bsd.shape
        q = self._query(x_bsd).view(bs, seq, -1, self.qk_head_dim)  # (bs, seq, heads, qk_hd)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = self.wkv_a(x_bsd).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        c_kv = self.kv_a_norm(c_kv)[:, :, None, :]  # (bs, seq, 1, kv_lora_rank)
        k_rope = k_rope[:, :, None, :]  # (bs, seq, 1, qk_rope_head_dim)
        if kv is None:
            per_token = cos.dim() == 3
            q_rope, k_rope = apply_rotary_emb(
                q_rope, k_rope, cos if per_token else cos[:seq], sin if per_token else sin[:seq]
            )
        else:
            q_rope, k_rope = apply_rotary_emb(q_rope, k_rope, cos, sin)
            c_kv, k_rope, mask = kv.update(c_kv, k_rope)  # (bs, kv_len, 1, ·), (bs,1,seq,kv_len)
        kv_len = c_kv.shape[1]
        kv_up = self.wkv_b(c_kv[:, :, 0])  # (bs, kv_len, heads * (qk_nope_head_dim + v_head_dim))
        kv_up = kv_up.view(bs, kv_len, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv_up.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        heads = k_nope.shape[2]
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)  # (bs, heads, seq, qk_hd)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, heads, -1)), dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)  # (bs, heads, kv_len, v_head_dim)
        scale = self.softmax_scale
        if self.record_max_logit and kv is None:
            m = max_logits(q, k, mask, scale)
            self.max_logit = m if self.max_logit is None else torch.maximum(self.max_logit, m)
        if hasattr(mask, "attend"):  # an attention built outside (context parallel's)
            out = mask.attend(q, k, v, scale)
        elif isinstance(mask, BlockMask):
            out = flex_kernel.flex_attend(q, k, v, mask, scale=scale)
        elif mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))  # out: (bs, heads, seq, v_hd)
