"""FlexAttention with a `BlockMask`, and attention sinks through its log-sum-exp.

A learned sink logit s_h per head (Xiao et al. 2023, arXiv:2309.17453; gpt-oss) joins every
softmax denominator and takes no value. With Z = Σ_j exp(l_j) = exp(lse) over the allowed keys
and o = Σ_j exp(l_j) v_j / Z the attention without the sink, the sink's softmax gives

    o' = Σ_j exp(l_j) v_j / (Z + exp(s_h)) = o · Z / (Z + exp(s_h)) = o · σ(lse − s_h),

so one FlexAttention call that also returns lse (`AuxRequest(lse=True)`) and a sigmoid gate are
exact, forward and backward: autograd reaches s_h through the gate and q, k through both o and
lse (FlexAttention's backward takes lse's gradient). A row with no allowed key has o = 0 and
lse = −inf, so o' = 0, as the sink alone would give.

The compiled kernel is what runs on a GPU. Where a GPU step is priced on fake CPU tensors (the
ledger, the memory estimator: `device_type` answers "cuda" for CPU tensors), `flex_call` runs
the kernel's stand-in op instead (`titanlab.models.common.flex_stand_in`).
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from titanlab.config.device_path import device_type
from titanlab.models.common.flex_masks import band_fraction
from titanlab.models.common.flex_stand_in import flex_attention_priced


@functools.cache
def compiled_flex_attention():
    """flex attention compiled once (eager flex attention materializes the scores)."""
    return torch.compile(flex_attention)


def flex_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    scale: float | None,
    lse: bool,
    window: int | None,
    fraction: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out (bs, H, q_len, dv) in q's dtype, lse (bs, H, q_len) float32 natural-log when `lse`,
    else None) of compiled FlexAttention over q, k (bs, H, ·, d), v (bs, H, kv_len, dv).
    `window` is the mask's band and `fraction` the share of its tiles to price when the caller
    knows better than the band of the last q_len of kv_len positions (context parallel's
    balanced ranks): the stand-in prices from them; the kernel reads the block mask."""
    if q.device.type != "cuda" and device_type(q) == "cuda":  # a GPU step priced on the CPU
        computed = (
            fraction if fraction is not None else band_fraction(q.shape[-2], k.shape[-2], window)
        )
        priced = flex_attention_priced(
            q, k, v, computed, scale if scale is not None else q.shape[-1] ** -0.5
        )
        return priced[0], priced[1] if lse else None
    if not lse:
        return compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale), None
    out, aux = compiled_flex_attention()(
        q, k, v, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True)
    )
    return out, aux.lse


def flex_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    fraction: float | None = None,
) -> torch.Tensor:
    """Attention of q (bs, H, q_len, d) over k (bs, H, kv_len, d) and v (bs, H, kv_len, dv)
    under `block_mask` (`titanlab.models.common.flex_masks`), with the sink logits `sinks`
    ((H,), any float dtype) in every softmax when given. Returns (bs, H, q_len, dv) in q's
    dtype. `window`: the band the mask holds, or None; `fraction`: see `flex_call`."""
    out, lse = flex_call(q, k, v, block_mask, scale, sinks is not None, window, fraction)
    if sinks is None:
        return out
    assert lse is not None
    return with_sinks(out, lse, sinks)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """out · σ(lse − s_h) (module docstring): attention `out` (bs, H, q_len, dv) over keys
    whose log-sum-exp is `lse` (bs, H, q_len), with the sink logits `sinks` (H,) joined."""
    gate = torch.sigmoid(lse.float() - sinks.float()[None, :, None])  # (bs, H, q_len)
    return (out.float() * gate[..., None]).to(out.dtype)
