"""Rotary position embedding (RoPE; Su et al. 2021, "RoFormer") with long-context scaling.

Two scalings stretch the frequencies for contexts longer than the model was pretrained on:
Llama 3.1's rule (`RopeScaling`) and YaRN (`YarnScaling`; Peng et al. 2023, arXiv:2309.00071,
the DeepSeek-V3 family's). YaRN also scales attention: the cos/sin tables are multiplied by
`rope_attention_factor` (so the rotated dims of every q·k score by its square), and DeepSeek-V3
multiplies the softmax scale d_qk**-0.5 by `softmax_mscale`. Both follow transformers 5
(`modeling_rope_utils._compute_yarn_parameters`, `DeepseekV3Attention`), and the frequencies are
computed in its floating-point order, so the tables agree bitwise on CPU.

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


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (Peng et al. 2023), as DeepSeek-V3 configures it; see
    `rope_frequencies`, `rope_attention_factor` and `softmax_mscale`.

    Raises:
        ValueError: factor, original_max_position_embeddings, beta_fast or beta_slow not > 0.
    """

    factor: float
    """Context extension ratio s: the low frequencies are divided by it (40 for DeepSeek-V3)."""
    original_max_position_embeddings: int
    """Context length L (tokens) before the extension; it places the ramp between the two betas."""
    beta_fast: float = 32.0
    """Frequencies turning more than this many times in L tokens are kept unchanged."""
    beta_slow: float = 1.0
    """Frequencies turning fewer than this many times in L tokens are divided by `factor`."""
    mscale: float = 1.0
    """Weight a of the cos/sin multiplier's numerator m(s, a) = 0.1·a·ln s + 1; 0 means unset."""
    mscale_all_dim: float = 0.0
    """Weight of the cos/sin multiplier's denominator and of the softmax multiplier m(s, a)²;
    0 means unset (no softmax multiplier)."""
    attention_factor: float | None = None
    """The cos/sin multiplier itself, overriding the one derived from the mscales."""
    truncate: bool = True
    """Round the ramp's ends to whole pair indices (floor / ceil), as the YaRN paper does."""

    def __post_init__(self) -> None:
        for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"YarnScaling {name}={value!r} must be > 0")


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | YarnScaling | None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """RoPE angular frequencies (radians per token), shape (head_dim // 2,) fp32.

    freq_i = theta ** (-2i / head_dim). With a `RopeScaling`, the Llama 3.1 rule (Meta
    llama-models `apply_scaling`; Llama 3 paper) rescales each frequency by its wavelength
    2*pi/freq, with L = original_max_position_embeddings:
    - wavelen > L / low_freq_factor: freq / factor;
    - wavelen < L / high_freq_factor: freq unchanged;
    - otherwise (1 - s) * freq / factor + s * freq, s = (L / wavelen - low) / (high - low).

    With a `YarnScaling`, YaRN's "NTK-by-parts" rule (Peng et al. 2023 §3.2; transformers
    `_compute_yarn_parameters`), with s = factor, L as above and n = head_dim:
    - corr(r) = n * ln(L / (2*pi*r)) / (2 ln theta), the pair index whose frequency turns r times
      in L tokens; lo = floor(corr(beta_fast)), hi = ceil(corr(beta_slow)) (unrounded when not
      `truncate`), clamped to [0, n - 1]; hi += 0.001 when they meet;
    - ramp_i = clamp((i - lo) / (hi - lo), 0, 1); freq'_i = freq_i * (1 - ramp_i) + freq_i / s * ramp_i
      (high frequencies kept, low ones interpolated).
    """
    period = theta ** (
        torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim
    )
    freqs = 1.0 / period
    if scaling is None:
        return freqs
    if isinstance(scaling, YarnScaling):
        return _yarn_frequencies(freqs, period, head_dim, theta, scaling)
    orig = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    out = torch.where(wavelen > orig / low, freqs / scaling.factor, blended)
    return torch.where(wavelen < orig / high, freqs, out)


def _yarn_frequencies(
    freqs: torch.Tensor, period: torch.Tensor, head_dim: int, theta: float, scaling: YarnScaling
) -> torch.Tensor:
    """YaRN's blend of `freqs` (head_dim // 2,) fp32 and `1 / (factor * period)`; see
    `rope_frequencies`. Each step is in transformers' floating-point order (bitwise on CPU)."""
    length = scaling.original_max_position_embeddings

    def pair_turning(rotations: float) -> float:  # corr(r): the (fractional) pair index
        return (head_dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001  # a step instead of a division by zero
    pair = torch.arange(head_dim // 2, dtype=torch.float32)
    ramp = torch.clamp((pair - lo) / (hi - lo), 0, 1).to(freqs.device)  # 1: interpolated
    kept = 1 - ramp  # the share of the original frequency
    return freqs * kept + (1.0 / (scaling.factor * period)) * (1 - kept)


def _yarn_mscale(factor: float, weight: float) -> float:
    """m(s, a) = 0.1·a·ln s + 1 for s > 1, else 1: the YaRN paper's sqrt(1/t) (§3.4), weighted
    as in DeepSeek's `yarn_get_mscale`."""
    if factor <= 1:
        return 1.0
    return 0.1 * weight * math.log(factor) + 1.0


def rope_attention_factor(scaling: RopeScaling | YarnScaling | None) -> float:
    """The multiplier on the cos and sin tables (the rotated dims of q·k scale by its square).

    1.0 without scaling and for `RopeScaling`. For `YarnScaling` (transformers
    `_compute_yarn_parameters`): `attention_factor` when set; else m(s, mscale) / m(s,
    mscale_all_dim) when both are non-zero; else m(s, 1), with s = factor and m as in
    `_yarn_mscale`. DeepSeek-V3 (mscale = mscale_all_dim) gets 1.0.
    """
    if not isinstance(scaling, YarnScaling):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    s = scaling.factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(s, scaling.mscale) / _yarn_mscale(s, scaling.mscale_all_dim)
    return _yarn_mscale(s, 1.0)


def softmax_mscale(scaling: RopeScaling | YarnScaling | None) -> float:
    """The multiplier on the attention softmax scale d_qk**-0.5 (transformers
    `DeepseekV3Attention.scaling`): m(s, mscale_all_dim)**2 for a `YarnScaling` with a non-zero
    `mscale_all_dim`, else 1.0. DeepSeek-V3 671B (s = 40): 1.873854."""
    if not isinstance(scaling, YarnScaling) or not scaling.mscale_all_dim:
        return 1.0
    m = _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return m * m


def precompute_rope_cos_sin(
    head_dim: int,
    end: int,
    theta: float,
    scaling: RopeScaling | YarnScaling | None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles position * freq, each shape (end, head_dim // 2) fp32,
    times `rope_attention_factor(scaling)` (YaRN only; 1.0 leaves the tables untouched).

    Frequencies (with optional Llama 3.1 or YaRN scaling) come from `rope_frequencies`.
    """
    freqs = rope_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(end, device=freqs.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos(), angles.sin()
    factor = rope_attention_factor(scaling)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin


def apply_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by position, Meta's interleaved pair layout, math in fp32.

    Elements (2i, 2i+1) of each head form pair i, rotated by angle position * freq_i: Meta's
    `view_as_complex(x.reshape(..., head_dim // 2, 2)) * freqs_cis`. Run eagerly on plain tensors
    it is that complex product (one kernel each way, as torchtitan's); under torch.compile
    (Inductor generates no code for complex operators) or on a wrapped tensor subclass (a
    DTensor) it is the same arithmetic in real pairs, which Inductor fuses into one kernel.

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
    if _as_complex(xq):
        turn = torch.complex(cos, sin)  # e^{i·angle}, complex64
        return _rotate_complex(xq, turn), _rotate_complex(xk, turn)
    return _rotate_real(xq, cos, sin), _rotate_real(xk, cos, sin)


def _as_complex(x: torch.Tensor) -> bool:
    """Whether `apply_rotary_emb` takes the complex product: eager, on a plain tensor."""
    return not torch.compiler.is_compiling() and not hasattr(x, "to_local")


def _rotate_complex(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) times `turn` (complex64, broadcast over pairs), back in x's dtype."""
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * turn).flatten(-2).type_as(x)


def _rotate_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The complex product (a + ib)(cos + i sin) written in real pairs, back in x's dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (bs, seq, heads, head_dim/2, 2)
    x_even, x_odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
