"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5 (Yang, Kautz and
Hatamizadeh 2024, "Gated Delta Networks", arXiv:2412.06464; the layer as Hugging Face's
`Qwen3_5GatedDeltaNet` builds it):

1. One projection gives q, k (H_k heads of d_k) and v (H_v heads of d_v); a causal depthwise
   convolution of K taps over the sequence, then SiLU, mixes each channel with its K − 1
   predecessors (Gu and Dao's Mamba short convolution).
2. q and k are L2-normalized per head (q then scaled by 1/√d_k); β = σ(b) and the log decay
   g = −exp(A_log) · softplus(a + dt_bias) per value head come from two small projections
   (Mamba-2's discretization, Dao and Gu 2024, arXiv:2405.21060).
3. The gated delta rule (`titanlab.models.common.delta_rule`) over the sequence, from the
   state a cache holds or from zeros.
4. A gated RMSNorm per value head: RMSNorm(o) · SiLU(z), z from a fourth projection; then the
   output projection.

Cost per token is constant in the sequence length: the state is H_v · d_k · d_v numbers and the
convolution keeps its last K − 1 inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlab.models.common import delta_rule
from titanlab.models.common.init import trunc_normal_


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim (fp32 statistics, Zhang and Sennrich 2019) times SiLU(gate):
    x, gate (..., d) → (..., d) in x's dtype. `weight` (d,) starts at ones."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / √(Σ x² + eps) over the last dim, in fp32 (flash-linear-attention's form)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """The layer (module docstring).

    Args:
        dim: model width. key_heads / value_heads: H_k and H_v (H_v a multiple of H_k);
        key_dim / value_dim: d_k and d_v per head; conv_kernel: K taps; eps: the gated norm's.

    Parameters: `wqkv` (dim → 2·H_k·d_k + H_v·d_v), `wz` (dim → H_v·d_v), `wb` and `wa`
    (dim → H_v), `conv` (2·H_k·d_k + H_v·d_v, 1, K) depthwise, `dt_bias` and `A_log` (H_v,),
    `norm` (d_v,), `wo` (H_v·d_v → dim).
    """

    def __init__(
        self, dim: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
        conv_kernel: int, eps: float,
    ) -> None:  # fmt: skip
        super().__init__()
        if value_heads % key_heads:
            raise ValueError(
                f"value_heads={value_heads} must be a multiple of key_heads={key_heads}"
            )
        self.key_heads, self.value_heads = key_heads, value_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        channels = 2 * key_heads * key_dim + value_heads * value_dim
        self.wqkv = nn.Linear(dim, channels, bias=False)
        self.wz = nn.Linear(dim, value_heads * value_dim, bias=False)
        self.wb = nn.Linear(dim, value_heads, bias=False)
        self.wa = nn.Linear(dim, value_heads, bias=False)
        self.conv = nn.Parameter(torch.empty(channels, 1, conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(value_heads))
        self.A_log = nn.Parameter(torch.empty(value_heads))
        self.norm = GatedRMSNorm(value_dim, eps)
        self.wo = nn.Linear(value_heads * value_dim, dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        """Projections truncated normal std 0.02 (`wo`: `out_std`), the convolution Kaiming
        uniform (PyTorch's Conv1d default), dt_bias ones, A uniform in [1, 16] (A_log its log,
        flash-linear-attention's range), the norm ones."""
        for w in (self.wqkv, self.wz, self.wb, self.wa):
            trunc_normal_(w.weight, 0.02)
        trunc_normal_(self.wo.weight, out_std)
        nn.init.kaiming_uniform_(self.conv, a=5**0.5)
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        self.norm.reset_parameters()

    def _convolved(self, mixed: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
        """SiLU of the causal depthwise convolution of `mixed` (bs, S, C) whose K − 1 inputs
        before it are `history` (bs, K − 1, C) or zeros. Returns (bs, S, C)."""
        taps = self.conv.shape[-1]
        x = mixed.transpose(1, 2)  # (bs, C, S)
        if history is None:
            x = F.pad(x, (taps - 1, 0))
        else:
            x = torch.cat([history.transpose(1, 2).to(x.dtype), x], dim=-1)
        return F.silu(F.conv1d(x, self.conv.to(x.dtype), groups=x.shape[1])).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x: (bs, S, dim). `state`: (the last K − 1 projected inputs (bs, K − 1, C), the delta
        rule's state (bs, H_v, d_k, d_v) float32) of the tokens before x, or None (a sequence's
        start). Returns ((bs, S, dim) in x's dtype, the state after x)."""
        bs, seq, _ = x.shape
        mixed = self.wqkv(x)
        history, memory = state if state is not None else (None, None)
        conv = self._convolved(mixed, history)
        keys = self.key_heads * self.key_dim
        q, k, v = conv.split([keys, keys, self.value_heads * self.value_dim], dim=-1)
        q = l2_normalized(q.reshape(bs, seq, -1, self.key_dim)) * self.key_dim**-0.5
        k = l2_normalized(k.reshape(bs, seq, -1, self.key_dim))
        v = v.reshape(bs, seq, -1, self.value_dim)
        beta = torch.sigmoid(self.wb(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.wa(x).float() + self.dt_bias.float())
        rule = delta_rule.recurrent if seq == 1 and memory is not None else delta_rule.chunked
        out, memory = rule(q, k, v, g, beta, memory)
        z = self.wz(x).reshape(bs, seq, -1, self.value_dim)
        out = self.norm(out, z).reshape(bs, seq, -1)
        taps = self.conv.shape[-1]
        before = history if history is not None else mixed.new_zeros(bs, taps - 1, mixed.shape[-1])
        history = torch.cat([before, mixed], dim=1)[:, -(taps - 1) :] if taps > 1 else before
        return self.wo(out), (history, memory)
