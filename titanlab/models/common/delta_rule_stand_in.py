"""The gated delta rule's GPU kernel, stood in for pricing a GPU step on fake CPU tensors (the
ledger, the memory estimator's traces): one op, `titanlab::gated_delta_attention`, with the
outputs of flash-linear-attention's chunked kernel (`delta_rule_kernel.fla_chunked`: out (bs,
S, H_v, d_v) in v's dtype, the final state (bs, H_v, d_k, d_v) float32), and its backward
`titanlab::gated_delta_attention_backward` (dq, dk, dv, dg, dbeta). `titanlab.ledger.flops`
counts their FLOPs (`chunk_flops`). Fake tensors only: a GPU runs fla's Triton kernels.

The count follows the chunked form (`titanlab.models.common.delta_rule`'s docstring; Yang et
al. 2024, arXiv:2406.06484, §3) in chunks of C = 64 tokens (fla's `chunk_gated_delta_rule`),
per chunk and value head, with d_k, d_v the head dims:
    K Kᵀ (2C²d_k), the triangular solve (C³/3 multiply-adds: 2C³/3 … taken as C³ with the
    two right-hand sides' products W_k = T K, W_v = T V: 2C²d_k + 2C²d_v),
    U = W_v − W_k M (2C d_k d_v), O = Q M + (Q Kᵀ ⊙ Γ) U (2C d_k d_v + 2C²d_k + 2C²d_v),
    M' = M + Kᵀ U (2C d_k d_v):
    6C²d_k + 4C²d_v + 6C d_k d_v + C³.
Backward: twice the forward (each product's two gradient products), the usual rule for
matmul work, not fla's exact count.
"""

from __future__ import annotations

import torch

CHUNK = 64
"""Tokens per chunk of fla's chunked kernel."""
_FAKE_ONLY = "titanlab::gated_delta_attention prices fla's kernel on fake tensors only"


def chunk_flops(q_shape, v_shape, chunk: int = CHUNK) -> int:
    """Forward FLOPs of the chunked gated delta rule on q (bs, S, H_k, d_k), v (bs, S, H_v,
    d_v): the module docstring's count per chunk × ⌈S / C⌉ chunks × bs × H_v."""
    bs, seq, _, dk = q_shape
    heads, dv = v_shape[-2], v_shape[-1]
    c = chunk
    per_chunk = 6 * c * c * dk + 4 * c * c * dv + 6 * c * dk * dv + c**3
    return bs * heads * -(-seq // c) * per_chunk


@torch.library.custom_op("titanlab::gated_delta_attention", mutates_args=())
def gated_delta_priced(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, final state) of fla's chunked kernel from a zero state; fake tensors only."""
    raise NotImplementedError(_FAKE_ONLY)


@gated_delta_priced.register_fake
def _(q, k, v, g, beta):
    bs, _, heads, dv = v.shape
    return v.new_empty(v.shape), v.new_empty((bs, heads, q.shape[-1], dv), dtype=torch.float32)


@torch.library.custom_op("titanlab::gated_delta_attention_backward", mutates_args=())
def gated_delta_backward_priced(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv, dg, dbeta) of `gated_delta_priced`; fake tensors only."""
    raise NotImplementedError(_FAKE_ONLY)


@gated_delta_backward_priced.register_fake
def _(grad_out, q, k, v, g, beta):
    return tuple(torch.empty_like(t) for t in (q, k, v, g, beta))


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grad(ctx, grad_out, grad_state):
    return gated_delta_backward_priced(grad_out, *ctx.saved_tensors)


gated_delta_priced.register_autograd(_grad, setup_context=_save)


def priced_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_rule.chunked`'s contract through the stand-in, with the casts `fla_chunked`
    makes (q, k and beta in v's dtype, g float32). A starting state (a cache, context
    parallel's carry) is priced as the zero state: the same kernel work."""
    out, final = gated_delta_priced(q.to(v.dtype), k.to(v.dtype), v, g.float(), beta.to(v.dtype))
    return out, final
