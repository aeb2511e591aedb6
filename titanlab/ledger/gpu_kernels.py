"""The attention kernel a CUDA GPU runs, in place of the one the CPU would pick: the ledger
records `F.scaled_dot_product_attention` as the fused kernel SDPA selects on the target.

On fake CPU tensors SDPA picks a CPU backend: its flash kernel where query, key and value share
a head dim, else the math fallback (the score matrix in fp32 through `bmm`, as MLA's 192/128
dims get). On CUDA, torch 2.11 picks (`torch/nn/attention` backend priority, measured on the
H100: docs/performance.md) cuDNN's flash attention on compute capability 9.0 and later,
FlashAttention-2 before, and the memory-efficient kernel where those refuse the arguments
(a value head dim that differs from the query's, an explicit mask), each only while enabled:
a `torch.nn.attention.sdpa_kernel` choice is honoured, down to SDPA's math fallback (explicit
score matrices). `gpu_sdpa` calls that
kernel's aten op, whose fake (meta) implementation and FLOP formula torch has, so the ledger
prices one fused kernel with its real FLOPs and no score matrix (`gpu_attention`).

FlexAttention (the CUDA path of document masks, sliding windows and sinks) needs no swap: on
CPU tensors under a CUDA code path, `titanlab.models.common.flex_kernel` itself runs its priced
stand-in (`titanlab::flex_attention`), whose FLOPs `titanlab.ledger.flops` counts.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from titanlab.config.device_path import Target

_aten = torch.ops.aten


def sdpa_kernel(target: Target, query: torch.Tensor, value: torch.Tensor, masked: bool) -> str:
    """The SDPA backend CUDA takes for these arguments on `target` among the backends enabled
    now (`torch.nn.attention.sdpa_kernel` and `torch.backends.cuda.enable_*_sdp` choose them):
    "cudnn", "flash", "efficient", or "math" (SDPA's unfused fallback, explicit score
    matrices) when none of the fused ones that take the arguments is enabled."""
    cuda = torch.backends.cuda
    same_dims = query.shape[-1] == value.shape[-1]
    if not masked and same_dims and target.capability >= (9, 0) and cuda.cudnn_sdp_enabled():
        return "cudnn"
    if not masked and same_dims and cuda.flash_sdp_enabled():
        return "flash"
    if cuda.mem_efficient_sdp_enabled():
        return "efficient"
    return "math"


def gpu_sdpa(
    target: Target, original: Any, query, key, value, attn_mask=None, dropout_p=0.0,
    is_causal=False, scale=None, enable_gqa=False,
) -> torch.Tensor:  # fmt: skip
    """`F.scaled_dot_product_attention` through the aten op of the kernel CUDA would run.
    Shapes as SDPA's: (batch, heads, seq, head_dim) → (batch, heads, seq, value head_dim).
    Inputs of another rank (the chunked sliding window's 5-D blocks) go to `original`: CUDA's
    fused kernels take 4-D inputs only, so SDPA runs its math fallback there as on the CPU."""
    if query.dim() != 4:
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)  # fmt: skip
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        n_rep = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(n_rep, dim=-3)
        value = value.repeat_interleave(n_rep, dim=-3)
    kernel = sdpa_kernel(target, query, value, attn_mask is not None)
    if kernel == "math":  # the CPU's SDPA takes its math path too under the same choice
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale)  # fmt: skip
    if kernel == "cudnn":
        return _aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, dropout_p, is_causal, scale=scale
        )[0]
    if kernel == "flash":
        return _aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, scale=scale
        )[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # SDPA's own conversion
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), query.new_zeros(()))
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return _aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, need_grad, dropout_p, is_causal, scale=scale
    )[0]


@contextlib.contextmanager
def gpu_attention(target: Target) -> Iterator[None]:
    """Inside, `F.scaled_dot_product_attention` runs `gpu_sdpa` for `target` (a CUDA device).

    The function itself is swapped (every caller looks it up in `torch.nn.functional` when it
    calls): a `TorchFunctionMode` would miss activation checkpointing's recomputation, which
    runs outside the mode, and the recomputed forward would then differ from the first."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = functools.partial(gpu_sdpa, target, original)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
