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

**Layout.** The rows of `wqkv` (and the channels of the convolution) are grouped by key head:
key head g's query rows, its key rows, then the rows of the H_v / H_k value heads it serves.
Hugging Face stores all queries, then all keys, then all values
(`titanlab.models.common.hf_hybrid` reorders them). Grouped this way, a contiguous split of the
rows over tensor-parallel ranks hands each rank whole groups, so the layer runs unchanged on its
local heads: every head count here comes from the tensors' sizes.

Cost per token is constant in the sequence length: the state is H_v · d_k · d_v numbers and the
convolution keeps its last K − 1 inputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titanlab.models.common import delta_rule
from titanlab.models.common.delta_rule import wide
from titanlab.models.common.delta_rule_kernel import chunked_rule
from titanlab.models.common.init import trunc_normal_

RecurrentState = tuple[torch.Tensor, torch.Tensor]
"""(the last K − 1 projected inputs (bs, K − 1, C), the delta rule's state (bs, H_v, d_k, d_v)
float32)."""


class HeadRMSNorm(nn.Module):
    """RMSNorm over the last dim, fp32 statistics (Zhang and Sennrich 2019), then `weight` (d,)
    (ones at init) times the normalized input cast back to its dtype: x (..., d) → (..., d)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(wide(x.dtype))
        return self.weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        )

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class ChannelParams(nn.Module):
    """Parameters with one row per channel or head, returned by `forward()` (so tensor parallel
    can split them by rows and hand the layer its rows as plain tensors:
    `titanlab.distributed.tensor_parallel.plan.ShardHeads`)."""

    def __init__(self, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))

    def forward(self) -> tuple[torch.Tensor, ...]:
        return tuple(p for _, p in self.named_parameters(recurse=False))


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def softplus(x: torch.Tensor) -> torch.Tensor:
    """`F.softplus(x)` whose backward gets a contiguous gradient: the decay's gradient arrives
    transposed (the rule runs heads-first), and torch 2.13's `softplus_backward` then returns
    the gradient's layout where its meta function predicts the input's, so a compiled block's
    backward failed on a `view` under AOTAutograd."""
    return _ContiguousGrad.apply(F.softplus(x))


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / √(Σ x² + eps) over the last dim, in fp32 (flash-linear-attention's form)."""
    xf = x.to(wide(x.dtype))
    return xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """The layer (module docstring).

    Args:
        dim: model width. key_heads / value_heads: H_k and H_v (H_v a multiple of H_k);
        key_dim / value_dim: d_k and d_v per head; conv_kernel: K taps; eps: the gated norm's.

    Parameters: `wqkv` (dim → C = 2·H_k·d_k + H_v·d_v, grouped by key head), `wz`
    (dim → H_v·d_v), `wb` and `wa` (dim → H_v), `conv.weight` (C, 1, K) depthwise,
    `decay.A_log` and `decay.dt_bias` (H_v,), `norm.weight` (d_v,), `wo` (H_v·d_v → dim).

    Raises:
        ValueError: value_heads not a multiple of key_heads.
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
        self.group = value_heads // key_heads  # value heads per key head
        self.key_dim, self.value_dim = key_dim, value_dim
        self.taps = conv_kernel
        channels = 2 * key_heads * key_dim + value_heads * value_dim
        self.wqkv = nn.Linear(dim, channels, bias=False)
        self.wz = nn.Linear(dim, value_heads * value_dim, bias=False)
        self.wb = nn.Linear(dim, value_heads, bias=False)
        self.wa = nn.Linear(dim, value_heads, bias=False)
        self.conv = ChannelParams(weight=(channels, 1, conv_kernel))
        self.decay = ChannelParams(A_log=(value_heads,), dt_bias=(value_heads,))
        self.norm = HeadRMSNorm(value_dim, eps)
        self.wo = nn.Linear(value_heads * value_dim, dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        """Projections truncated normal std 0.02 (`wo`: `out_std`), the convolution Kaiming
        uniform (PyTorch's Conv1d default), dt_bias ones, A uniform in [1, 16] (A_log its log,
        flash-linear-attention's range), the norm ones."""
        for w in (self.wqkv, self.wz, self.wb, self.wa):
            trunc_normal_(w.weight, 0.02)
        trunc_normal_(self.wo.weight, out_std)
        (conv,), (a_log, dt_bias) = self.conv(), self.decay()
        nn.init.kaiming_uniform_(conv, a=5**0.5)
        nn.init.ones_(dt_bias)
        with torch.no_grad():
            a_log.copy_(torch.empty_like(a_log).uniform_(1, 16).log())
        self.norm.reset_parameters()

    def _convolved(
        self,
        mixed: torch.Tensor,
        weight: torch.Tensor,
        history: torch.Tensor | None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """SiLU of the causal depthwise convolution of `mixed` (bs, S, C) whose K − 1 inputs
        before it are `history` (bs, K − 1, C) or zeros. With `segments` (bs, S) int64 document
        ids, each tap reads only inputs of the output token's own document (the others count as
        zeros, as before a sequence's start). Returns (bs, S, C)."""
        x = mixed.transpose(1, 2)  # (bs, C, S)
        if history is None:
            x = F.pad(x, (self.taps - 1, 0))
        else:
            x = torch.cat([history.transpose(1, 2).to(x.dtype), x], dim=-1)
        w = weight.to(x.dtype)
        if segments is None:
            return F.silu(F.conv1d(x, w, groups=x.shape[1])).transpose(1, 2)
        windows = x.unfold(2, self.taps, 1)  # (bs, C, S, K): tap j reads token t − K + 1 + j
        ids = F.pad(segments, (self.taps - 1, 0), value=-1).unfold(1, self.taps, 1)  # (bs, S, K)
        same = (ids == segments[..., None]).to(x.dtype)[:, None]  # (bs, 1, S, K)
        out = (windows * same * w[:, 0][None, :, None, :]).sum(-1)  # (bs, C, S)
        return F.silu(out).transpose(1, 2)

    def step(
        self,
        x: torch.Tensor,
        state: RecurrentState | None = None,
        carry: Any = None,
        segments: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RecurrentState]:
        """x: (bs, S, dim); `state`: the `RecurrentState` of the tokens before x, or None (a
        sequence's start). Returns ((bs, S, dim) in x's dtype, the state after x).

        `carry` (context parallel, `titanlab.distributed.context_parallel.linear.SequenceCarry`): x
        holds this rank's tokens in its load balancer's order; the convolution and the rule run on
        the rank's contiguous piece, from the earlier pieces' inputs and state, and the output
        comes back in x's order (the returned state is then the piece's own).

        `segments` (training with packed documents): (bs, S) int64 document ids; the convolution
        and the rule restart at each document's first token, so each document runs as if alone
        (`delta_rule.documents`)."""
        bs, seq, _ = x.shape
        mixed, b, a = self.wqkv(x), self.wb(x), self.wa(x)  # (bs, S, C / H_v / H_v local)
        history, memory = state if state is not None else (None, None)
        if carry is not None:
            mixed, b, a = carry.to_contiguous(mixed, b, a)
            history = carry.history(mixed, self.taps)
        (weight,) = self.conv()
        conv = self._convolved(mixed, weight, history, segments)
        dk, dv, group = self.key_dim, self.value_dim, self.group
        grouped = conv.reshape(bs, seq, -1, 2 * dk + group * dv)  # (bs, S, H_k local, ·)
        q, k, v = grouped.split([dk, dk, group * dv], dim=-1)
        q = l2_normalized(q) * dk**-0.5
        k = l2_normalized(k)
        v = v.reshape(bs, seq, -1, dv)  # (bs, S, H_v local, d_v)
        a_log, dt_bias = self.decay()
        f = wide(x.dtype)  # fp32 (fp64 for fp64 inputs)
        beta = torch.sigmoid(b.to(f))
        g = -a_log.to(f).exp() * softplus(a.to(f) + dt_bias.to(f))
        if carry is not None:
            memory = carry.initial_state(k, v, g, beta)
        if segments is not None:  # PyTorch's rule: documents are not wired to fla's kernel
            starts = F.pad(segments[:, 1:] != segments[:, :-1], (1, 0), value=False)
            out, memory = delta_rule.chunked(q, k, v, g, beta, memory, starts=starts)
        else:
            rule = delta_rule.recurrent if seq == 1 and memory is not None else chunked_rule(v)
            out, memory = rule(q, k, v, g, beta, memory)
        if carry is not None:
            out = carry.from_contiguous(out)
        z = self.wz(x).reshape(bs, seq, -1, dv)
        out = (self.norm(out.to(x.dtype)) * F.silu(z.to(f))).to(x.dtype).reshape(bs, seq, -1)
        before = (
            history if history is not None else mixed.new_zeros(bs, self.taps - 1, mixed.shape[-1])
        )
        history = (
            torch.cat([before, mixed], dim=1)[:, -(self.taps - 1) :] if self.taps > 1 else before
        )
        return self.wo(out), (history, memory)

    def forward(
        self,
        x: torch.Tensor,
        cos: Any = None,
        sin: Any = None,
        kv: Any = None,
        mask: Any = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block's call, `Attention`'s signature: x (bs, S, dim) → (bs, S, dim). cos and sin
        are the full-attention layers' and unused here. `mask`: under context parallel,
        titanlab's CP attention object, whose `recurrent_carry` this layer runs through (see
        `step`); any other mask is unused: documents come as `segments` (see `step`; the
        layout validator refuses them under context parallel). `kv` (generation) is a
        `titanlab.models.common.kv_cache.LayerCache`: the layer starts from the state it holds,
        left padding is zeroed first (a zero input leaves a zero state zero: its k and v are 0),
        and the state after x goes back into it."""
        carry = getattr(mask, "recurrent_carry", None)
        if carry is not None:  # context parallel shards one document per row (the validator
            # refuses packed documents there): its `segments` are the shard's, all one id
            return self.step(x, carry=carry)[0]
        if kv is None:
            return self.step(x, segments=segments)[0]
        x = x * kv.real_tokens(x.shape[1])[..., None].to(x.dtype)
        out, state = self.step(x, kv.recurrent())
        kv.keep_recurrent(state)
        return out
