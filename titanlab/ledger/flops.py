"""FLOPs of the ops the ledger records: torch's formulas (`torch.utils.flop_counter`), plus those
torch has none for (the CPU flash-attention kernels the fake step may run, grouped GEMM,
FlexAttention's priced stand-in), and what a flash kernel computes of a causal score matrix."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

import titanlab.models.common.flex_stand_in  # noqa: F401  (defines the titanlab:: ops)
from titanlab.models.common.delta_rule_stand_in import chunk_flops


def _grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """`torch._grouped_mm(a (tokens, k), b (groups, k, n), offs)`: each token row meets one
    group's (k, n) matrix, 2·tokens·k·n FLOPs (2D × 3D, the MoE experts' form)."""
    return 2 * a.shape[0] * a.shape[-1] * b.shape[-1] if b.dim() == 3 else 0


def _flex_flops(q, k, v, computed, scale, *args, out_val=None, **kwargs) -> int:
    """`titanlab::flex_attention`: SDPA's forward FLOPs times the share of tiles computed."""
    return int(sdpa_flop_count(q.shape, k.shape, v.shape) * computed)


def _flex_backward_flops(grad_out, q, k, v, out, lse, computed, scale, *args, out_val=None,
                         **kwargs) -> int:  # fmt: skip
    """Its backward: SDPA's backward FLOPs times the share of tiles computed."""
    return int(sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape) * computed)


def _delta_flops(q, k, v, g, beta, *args, out_val=None, **kwargs) -> int:
    """`titanlab::gated_delta_attention`: the chunked rule's FLOPs (`chunk_flops`)."""
    return chunk_flops(q.shape, v.shape)


def _delta_backward_flops(grad_out, q, k, v, g, beta, *args, out_val=None, **kwargs) -> int:
    """Its backward: twice the forward's (`titanlab.models.common.delta_rule_stand_in`)."""
    return 2 * chunk_flops(q.shape, v.shape)


def _flop_formulas() -> dict[Any, Any]:
    """torch's FLOP formulas, plus those it has none for: the CPU flash-attention kernels the
    fake step runs (the same arguments as the CUDA ones, so their formulas) and grouped GEMM."""
    aten = torch.ops.aten
    table = dict(flop_registry)
    table[aten.addmm_] = flop_registry[aten.addmm]  # in place, the same arguments
    table[aten._scaled_dot_product_flash_attention_for_cpu] = flop_registry[
        aten._scaled_dot_product_flash_attention
    ]
    table[aten._scaled_dot_product_flash_attention_for_cpu_backward] = flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ]
    if hasattr(aten, "_grouped_mm"):
        table[aten._grouped_mm] = _grouped_mm_flops
        table[aten._scaled_grouped_mm] = _grouped_mm_flops  # float8 experts: the same count
    table[torch.ops.titanlab.flex_attention] = _flex_flops  # FlexAttention's stand-in
    table[torch.ops.titanlab.flex_attention_backward] = _flex_backward_flops
    table[torch.ops.titanlab.gated_delta_attention] = _delta_flops  # fla's kernel's stand-in
    table[torch.ops.titanlab.gated_delta_attention_backward] = _delta_backward_flops
    return table


FLOPS = _flop_formulas()


ATTENTION_TILE = 128
"""Query and key rows per tile of the GPU's flash-attention kernels (FlashAttention-2/3 and
cuDNN's use 64-128; the fraction below moves by under 1% between them at seq_len 8192)."""


def causal_fraction(seq_len: int, tile: int = ATTENTION_TILE) -> float:
    """The share of a causal (seq_len × seq_len) score matrix a flash kernel computes: it skips
    the tiles above the diagonal, so of n × n tiles (n = ⌈seq_len / tile⌉) it runs n(n+1)/2;
    torch's FLOP formulas count the whole square. Source: Dao, "FlashAttention-2" (2023), §3.1.1
    (causal masking skips the blocks above the diagonal, about half of them)."""
    n = -(-seq_len // tile)
    return (n + 1) / (2 * n)


def argument(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The value of `func`'s argument `name` in this call (its default when not passed)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            if i < len(args) and not arg.kwarg_only:
                return args[i]
            return kwargs.get(name, arg.default_value)
    return None
