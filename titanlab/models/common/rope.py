"""Rotary position embedding (RoPE; Su et al. 2021, "RoFormer") with Llama 3.1 frequency scaling.

titanlab rotates the interleaved pairs (2i, 2i+1) of each head, like Meta's reference; Hugging
Face rotates the halves (i, i + head_dim/2). The two agree after a fixed reordering of the q/k
projection rows (and of a per-head q/k norm weight), which the families' HF adapters apply
(`titanlab.models.common.hf_adapter`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling (long-context extension); see `rope_frequencies`."""

    factor: float = 8.0
    """Divisor applied to the low frequencies (8 for Llama 3.1, 32 for Llama 3.2 1B/3B)."""
    low_freq_factor: float = 1.0
    """Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled fully."""
    high_freq_factor: float = 4.0
    """Wavelengths below `original_max_position_embeddings / high_freq_factor` are unchanged."""
    original_max_position_embeddings: int = 8192
    """Context length (tokens) of the model before the long-context extension."""


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device | None = None
) -> torch.Tensor:
    """RoPE angular frequencies (radians per token), shape (head_dim // 2,) fp32.

    freq_i = theta ** (-2i / head_dim). With `scaling`, the Llama 3.1 rule (Meta llama-models
    `apply_scaling`; Llama 3 paper) rescales each frequency by its wavelength 2*pi/freq, with
    L = original_max_position_embeddings:
    - wavelen > L / low_freq_factor: freq / factor;
    - wavelen < L / high_freq_factor: freq unchanged;
    - otherwise (1 - s) * freq / factor + s * freq, s = (L / wavelen - low) / (high - low).
    """
    freqs = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim
    )
    if scaling is None:
        return freqs
    orig = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    out = torch.where(wavelen > orig / low, freqs / scaling.factor, blended)
    return torch.where(wavelen < orig / high, freqs, out)


def precompute_rope_cos_sin(
    head_dim: int,
    end: int,
    theta: float,
    scaling: RopeScaling | None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles position * freq, each shape (end, head_dim // 2) fp32.

    Frequencies (with optional Llama 3.1 scaling) come from `rope_frequencies`.
    """
    freqs = rope_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(end, device=freqs.device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by position, Meta's interleaved pair layout, in real arithmetic.

    Elements (2i, 2i+1) of each head form pair i, rotated by angle position * freq_i: the same as
    Meta's `view_as_complex(x.reshape(..., head_dim // 2, 2)) * freqs_cis`, but without complex
    tensors (awkward under DTensor and torch.compile). Math runs in fp32.

    Args:
        xq: (bs, seq, n_heads, head_dim); xk: (bs, seq, n_kv_heads, head_dim), any float dtype.
        cos, sin: (seq, head_dim // 2), from `precompute_rope_cos_sin` sliced to seq; or
            (bs, seq, head_dim // 2), each sequence at its own positions (generation).
    Returns:
        (xq, xk) rotated, same shapes and dtypes as the inputs.
    """
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos = cos[:, :, None, :].float()  # (1 or bs, seq, 1, head_dim/2)
    sin = sin[:, :, None, :].float()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.float().unflatten(-1, (-1, 2))  # (bs, seq, heads, head_dim/2, 2)
        x_even, x_odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2).type_as(x)

    return rotate(xq), rotate(xk)
