"""FlexAttention's stand-in for pricing a GPU step on fake CPU tensors (the ledger, the memory
estimator's activation traces): one op, `titanlab::flex_attention`, with the compiled kernel's
outputs (out (bs, H, q_len, dv) in q's dtype, lse (bs, H, q_len) float32), its backward
`titanlab::flex_attention_backward` (dq, dk, dv), and what backward keeps (q, k, v, out, lse,
as the kernel's own backward does). `computed` is the share of (128 × 128) tiles the block mask
computes (`flex_masks.band_fraction`: exact for windows and causal masks, an upper bound for
document masks, whose tiles fake tensors do not say); `titanlab.ledger.flops` prices the two ops
as SDPA's FLOPs times it. Fake tensors only: the GPU runs the compiled kernel
(`flex_kernel.flex_call`).
"""

from __future__ import annotations

import torch

_FAKE_ONLY = "titanlab::flex_attention prices FlexAttention on fake tensors only"


@torch.library.custom_op("titanlab::flex_attention", mutates_args=())
def flex_attention_priced(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, computed: float, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of FlexAttention computing `computed` of the tiles; fake tensors only."""
    raise NotImplementedError(_FAKE_ONLY)


@flex_attention_priced.register_fake
def _(q, k, v, computed, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("titanlab::flex_attention_backward", mutates_args=())
def flex_attention_backward_priced(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, computed: float, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) of `flex_attention_priced`; fake tensors only."""
    raise NotImplementedError(_FAKE_ONLY)


@flex_attention_backward_priced.register_fake
def _(grad_out, q, k, v, out, lse, computed, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save(ctx, inputs, output):
    q, k, v, computed, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.computed, ctx.scale = computed, scale


def _grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flex_attention_backward_priced(
        grad_out, q, k, v, out, lse, ctx.computed, ctx.scale
    )
    return dq, dk, dv, None, None


flex_attention_priced.register_autograd(_grad, setup_context=_save)
