"""Qwen3.5's training FLOPs per token: the linear-attention layers' cost is linear in the
sequence.

The parameters' matmuls are 6 · N as for every family (N: active non-embedding parameters; the
linear layers' projections and convolution included). On top, per token:

- a full-attention layer: 6 · H · 2 · head_dim · T (`common.counting.attention_flops_per_token`,
  PaLM's count, no causal discount);
- a Gated DeltaNet layer, the chunked rule's matmuls (`common/delta_rule.py`, chunks of C = 64
  tokens; Yang et al. 2024, arXiv:2406.06484 §3, O(C · d + d²) per token and head). Per value
  head and token, in multiply-adds: C · d_k for Q Kᵀ and C · d_k for the system's K Kᵀ, C · d_v
  for the intra-chunk (Q Kᵀ ⊙ Γ) U, C · (d_k + d_v) / 2 for the two triangular solves, and
  3 · d_k · d_v for Q M_0, W_k M_0 and the state's K̃ᵀ U; at 6 FLOPs per multiply-add over
  forward and backward: 6 · H_v · (C · (2.5 · d_k + 1.5 · d_v) + 3 · d_k · d_v), whatever T.
"""

from __future__ import annotations

from typing import Any

from titanlab.models.common.counting import attention_flops_per_token
from titanlab.models.common.delta_rule import CHUNK


def linear_layer_flops_per_token(args: Any) -> int:
    """Training FLOPs per token of one Gated DeltaNet layer's delta rule (module docstring)."""
    dk, dv = args.linear_key_dim, args.linear_value_dim
    per_head = CHUNK * (5 * dk + 3 * dv) // 2 + 3 * dk * dv
    return 6 * args.linear_value_heads * per_head


def qwen3_5_flops_per_token(args: Any, seq_len: int, n_params_non_embedding: int) -> int:
    """6 · N + (full layers) · 6 · H · 2 · head_dim · T + (linear layers) ·
    `linear_layer_flops_per_token`.

    Args:
        args: the model's shape; seq_len: T, tokens per sequence; n_params_non_embedding: N
            (the active count for MoE, `count_active_params`).
    Returns:
        Training (forward + backward) FLOPs per token.
    """
    linear = sum(args.layer_type(i) == "linear_attention" for i in range(args.n_layers))
    full = args.n_layers - linear
    return (
        6 * n_params_non_embedding
        + full * attention_flops_per_token(args, seq_len)
        + linear * linear_layer_flops_per_token(args)
    )
