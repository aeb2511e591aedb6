"""Ring attention with the `alltoall` rotation for titanlab's context parallel
(`titanlab.distributed.context_parallel.documents`): the key/value shards travel the ring one step
at a time and each rank merges its partial softmaxes by their log-sum-exp (Liu et al. 2023, "Ring
Attention", arXiv:2310.01889), keeping only q, its own k and v, the output and the log-sum-exp
for backward, which travels the ring again. Two kernels per shard, chosen by the caller:

- `ring_attention` (CPU): fp32 scores of each shard under its slice of the dense mask, and the
  FlashAttention-2 backward per shard (Dao 2023, arXiv:2307.08691) from the saved log-sum-exp.
  A sink logit s_h per head (gpt-oss) is the merge's starting point: a key of logit s_h and
  value 0 (out 0, lse s_h), whose gradient is −Σ_rows exp(s_h − lse)·(dout · out).
- `flex_ring_attention` (CUDA): FlexAttention per shard under its block mask, returning
  (out, lse) merged as above; backward recomputes each shard's FlexAttention and hands it the
  gradients of its (out_j, lse_j). With w_j = exp(lse_j − L), O = Σ_j w_j o_j and
  L = log Σ_j exp(lse_j): ∂ℓ/∂o_j = w_j·g and ∂ℓ/∂lse_j = w_j·(g·o_j − g·O + g_L), for
  g = ∂ℓ/∂O and g_L = ∂ℓ/∂L (the sinks' gate, applied to O and L by the caller, gives g_L).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titanlab.distributed.context_parallel.collectives import shift
from titanlab.models.common import flex_kernel

NO_KEY = -1e30
"""The log-sum-exp of a row with no allowed key yet (finite: exp(NO_KEY − lse) = 0)."""


def _scores(q, k, mask, scale: float) -> torch.Tensor:
    """fp32 scores of q (bs, H, Sq, d) against one key shard k (bs, H, Sk, d), disallowed
    pairs at NO_KEY (a shard with no allowed key gets weight exp(NO_KEY - lse) = 0)."""
    return (q.float() @ k.float().transpose(-1, -2) * scale).masked_fill(~mask, NO_KEY)


def _start(q: torch.Tensor, dv: int, sinks: torch.Tensor | None):
    """(out (bs, H, Sq, dv), lse (bs, H, Sq)) float32 before any shard: nothing, or the sink."""
    out = torch.zeros(*q.shape[:-1], dv, dtype=torch.float32, device=q.device)
    if sinks is None:
        return out, torch.full(q.shape[:-1], NO_KEY, dtype=torch.float32, device=q.device)
    return out, sinks.float()[None, :, None].expand(q.shape[:-1]).contiguous()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale: float, group, sinks):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local = k.shape[2]
        kj, vj = k, v
        out, lse = _start(q, v.shape[-1], sinks)
        for step in range(world):
            if step:
                kj, vj = shift(kj, 1, group), shift(vj, 1, group)
            src = (rank - step) % world
            scores = _scores(q, kj, mask[..., src * local : (src + 1) * local], scale)
            merged = torch.logaddexp(lse, torch.logsumexp(scores, dim=-1))
            out = (
                out * torch.exp(lse - merged)[..., None]
                + torch.exp(scores - merged[..., None]) @ vj.float()
            )
            lse = merged
        ctx.save_for_backward(q, k, v, mask, out, lse, sinks)
        ctx.scale, ctx.group = scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse, sinks = ctx.saved_tensors
        scale, local = ctx.scale, k.shape[2]
        do = grad_out.float()
        delta = (do * out).sum(-1, keepdim=True)  # (bs, H, Sq, 1)

        def shard(src: int, kj: torch.Tensor, vj: torch.Tensor):
            p = torch.exp(_scores(q, kj, mask[..., src * local : (src + 1) * local], scale)
                          - lse[..., None])  # fmt: skip
            ds = p * (do @ vj.float().transpose(-1, -2) - delta)
            return (
                ds @ kj.float() * scale,
                ds.transpose(-1, -2) @ q.float() * scale,
                p.transpose(-1, -2) @ do,
            )

        dq, dk, dv = _ring_backward(k, v, ctx.group, shard)
        dsinks = None
        if sinks is not None:
            p_sink = torch.exp(sinks.float()[None, :, None] - lse)  # (bs, H, Sq)
            dsinks = -(p_sink * delta[..., 0]).sum(dim=(0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, dsinks


def _ring_backward(k: torch.Tensor, v: torch.Tensor, group, shard) -> tuple[torch.Tensor, ...]:
    """Backward's trip round the ring: `shard(src, k_src, v_src)` gives (dq, dk_src, dv_src)
    float32 of the key/value shard of rank `src`; the shards' key and value gradients travel
    with them and come home after one more step. Returns (dq, dk, dv) float32."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    kj, vj = k, v
    dq: torch.Tensor | None = None
    dkj = torch.zeros_like(k, dtype=torch.float32)
    dvj = torch.zeros_like(v, dtype=torch.float32)
    for step in range(world):
        if step:
            kj, vj = shift(kj, 1, group), shift(vj, 1, group)
            dkj, dvj = shift(dkj, 1, group), shift(dvj, 1, group)
        gq, gk, gv = shard((rank - step) % world, kj, vj)
        dq = gq if dq is None else dq + gq
        dkj, dvj = dkj + gk, dvj + gv
    assert dq is not None
    return dq, shift(dkj, 1, group), shift(dvj, 1, group)  # home: one more step


def ring_attention(q, k, v, mask, scale: float, group, sinks=None) -> torch.Tensor:
    """softmax(q kᵀ·scale + mask) v over the ring (CPU): q (bs, H, S/cp, d), k and v
    (bs, H, S/cp, d / dv) this rank's, `mask` (bs, 1, S/cp, S) bool against all ranks' keys
    in rank order, `sinks` (H,) or None. Returns (bs, H, S/cp, dv) in q's dtype."""
    return _RingAttention.apply(q, k, v, mask, scale, group, sinks)


class _FlexRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, masks, scale: float, group, fraction: float):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        kj, vj = k, v
        out, lse = _start(q, v.shape[-1], None)
        for step in range(world):
            if step:
                kj, vj = shift(kj, 1, group), shift(vj, 1, group)
            o_j, lse_j = _shard(q, kj, vj, masks[(rank - step) % world], scale, fraction)
            merged = torch.logaddexp(lse, lse_j)
            out = (
                out * torch.exp(lse - merged)[..., None]
                + o_j.float() * torch.exp(lse_j - merged)[..., None]
            )
            lse = merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.masks, ctx.scale, ctx.group, ctx.fraction = masks, scale, group, fraction
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        g = grad_out.float()
        g_lse = grad_lse.float() if grad_lse is not None else torch.zeros_like(lse)
        g_out_dot = (g * out).sum(-1)  # g·O, (bs, H, Sq)

        def shard(src: int, kj: torch.Tensor, vj: torch.Tensor):
            with torch.enable_grad():
                qi, ki, vi = (t.detach().requires_grad_() for t in (q, kj, vj))
                o_j, lse_j = _shard(qi, ki, vi, ctx.masks[src], ctx.scale, ctx.fraction)
                w = torch.exp(lse_j.detach() - lse)  # (bs, H, Sq)
                d_o = (w[..., None] * g).to(o_j.dtype)
                d_lse = w * ((g * o_j.detach().float()).sum(-1) - g_out_dot + g_lse)
                grads = torch.autograd.grad((o_j, lse_j), (qi, ki, vi), (d_o, d_lse))
            return tuple(t.float() for t in grads)

        dq, dk, dv = _ring_backward(k, v, ctx.group, shard)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _shard(q, k, v, mask, scale: float, fraction: float):
    """(out, lse) of FlexAttention of q against one key shard."""
    out, lse = flex_kernel.flex_call(q, k, v, mask, scale, True, None, fraction)
    assert lse is not None
    return out, lse


def flex_ring_attention(q, k, v, masks, scale: float, group, fraction: float):
    """(out (bs, H, S/cp, dv) in q's dtype, lse (bs, H, S/cp) float32) of q against every
    rank's keys and values over the ring (CUDA), shard j under `masks[j]` (BlockMasks of this
    rank's queries against rank j's keys); `fraction`: the share of each shard's tiles the
    ledger prices (a balanced rank's mean)."""
    return _FlexRing.apply(q, k, v, masks, scale, group, fraction)
