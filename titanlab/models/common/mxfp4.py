"""MXFP4 dequantization: the packed FP4 expert weights of OpenAI's gpt-oss checkpoints.

MXFP4 is the OCP Microscaling format (OCP "Microscaling Formats (MX) Specification" v1.0,
2023, the MXFP4 format): blocks of 32 FP4 E2M1 elements share one E8M0 scale (an 8-bit exponent,
bias 127, value 2**(scale - 127); 0xFF is NaN). The gpt-oss model card (OpenAI, "gpt-oss-120b &
gpt-oss-20b Model Card", 2025) ships the MoE expert weights this way: for a parameter `name`
the checkpoint holds `name_blocks` (uint8, (E, rows, G, 16): each byte packs two elements, the
low nibble first) and `name_scales` (uint8, (E, rows, G)). Dequantized, a tensor is
(E, rows, G * 32), "out, in"; the model's `gate_up_proj` / `down_proj` parameters are that with
the last two dims swapped, (E, G * 32, rows), as `transformers` loads them.

Every element is a table value times a power of two, computed in fp32 and cast once: exact in
fp32 and bf16 (both span 2**-133 to 2**127), except a product past the fp32 range,
possible only with scale 254, which becomes +-inf; a block with scale 0xFF is all NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# FP4 E2M1 code -> value (bit 3 sign, bits 2-1 exponent with bias 1, bit 0 mantissa).
FP4_E2M1_VALUES: tuple[float, ...] = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip


def check_mxfp4(name: str, blocks_shape: Sequence[int], scales_shape: Sequence[int]) -> None:
    """Check the shapes of an MXFP4 pair from headers alone: blocks (..., G, 16) with at least
    2 dims, scales (..., G) = blocks' shape without its last dim. Raises `ValueError` (one line
    naming `name`, the fault and what would be valid) otherwise."""
    b, s = tuple(blocks_shape), tuple(scales_shape)
    if len(b) < 2:
        raise ValueError(f"{name}: blocks shape {b} has {len(b)} dims; need (..., G, 16)")
    if b[-1] != 16:
        raise ValueError(f"{name}: blocks shape {b} ends in {b[-1]}; need (..., G, 16)")
    if s != b[:-1]:
        raise ValueError(f"{name}: scales shape {s} does not match blocks {b}; need {b[:-1]}")


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(256, 2) fp32: byte -> (value of low nibble, value of high nibble); (256,) fp32: E8M0
    scale byte -> 2**(s - 127), built from fp32 bit patterns so that it is exact (0 is the
    subnormal 2**-127, 255 NaN)."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=device)
    s = torch.arange(256, dtype=torch.int32, device=device)
    pairs = torch.stack((lut[s & 0x0F], lut[s >> 4]), dim=-1)
    bits = torch.where(s > 0, s << 23, torch.full_like(s, 1 << 22))
    bits[255] = 0x7FC00000
    return pairs, bits.view(torch.float32)


def _fill(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, chunk: int) -> None:
    """Dequantize blocks (n, G, 16) and scales (n, G) into out (n, G * 32), any strides."""
    pairs, powers = _tables(blocks.device)
    n, g = scales.shape
    for r0 in range(0, n, chunk):
        r1 = min(r0 + chunk, n)
        vals = pairs[blocks[r0:r1].to(torch.int32)]  # (rows, G, 16, 2): element 2j, 2j + 1
        vals.mul_(powers[scales[r0:r1].to(torch.int32)][:, :, None, None])
        out[r0:r1].copy_(vals.view(r1 - r0, g * 32))


def _check(name: str, blocks: torch.Tensor, scales: torch.Tensor, rows_per_chunk: int) -> None:
    check_mxfp4(name, blocks.shape, scales.shape)
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: blocks/scales are {blocks.dtype}/{scales.dtype}; need uint8")
    if rows_per_chunk < 1:
        raise ValueError(f"{name}: rows_per_chunk={rows_per_chunk}; need >= 1")


def dequantize_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    rows_per_chunk: int = 32768,
    name: str = "mxfp4",
) -> torch.Tensor:
    """Dequantize blocks uint8 (..., rows, G, 16) with scales uint8 (..., rows, G) into a new
    contiguous (..., rows, G * 32) tensor in `dtype` on blocks' device. Works on at most
    `rows_per_chunk` rows (all leading dims flattened) at a time, so the temporaries stay about
    twice a chunk's fp32 size. Raises `ValueError` (one line naming `name`) for shapes
    `check_mxfp4` refuses, a dtype other than uint8 or rows_per_chunk < 1."""
    _check(name, blocks, scales, rows_per_chunk)
    *lead, g, _ = blocks.shape
    out = torch.empty(*lead, g * 32, dtype=dtype, device=blocks.device)
    n = math.prod(lead)
    _fill(blocks.reshape(n, g, 16), scales.reshape(n, g), out.view(n, g * 32), rows_per_chunk)
    return out


def dequantize_gpt_oss_experts(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    rows_per_chunk: int = 32768,
    name: str = "gpt-oss experts",
) -> torch.Tensor:
    """gpt-oss expert weights: blocks uint8 (E, rows, G, 16), scales uint8 (E, rows, G) ->
    contiguous (E, G * 32, rows) in `dtype`, the dequantized (E, rows, G * 32) with its last
    two dims swapped: `GptOssExperts.gate_up_proj` (E, hidden, 2 * intermediate) or `down_proj`
    (E, intermediate, hidden). Written straight into that layout (no second full-size copy).
    Raises `ValueError` as `dequantize_mxfp4` does, and for blocks with fewer than 3 dims."""
    _check(name, blocks, scales, rows_per_chunk)
    if blocks.dim() < 3:
        raise ValueError(f"{name}: blocks shape {tuple(blocks.shape)}; need (E, rows, G, 16)")
    *lead, rows, g, _ = blocks.shape
    out = torch.empty(*lead, g * 32, rows, dtype=dtype, device=blocks.device)
    p = math.prod(lead)
    b, s = blocks.reshape(p, rows, g, 16), scales.reshape(p, rows, g)
    view = out.transpose(-1, -2).view(p, rows, g * 32)
    for i in range(p):
        _fill(b[i], s[i], view[i], rows_per_chunk)
    return out
