"""MXFP4-packed tensors of a Hugging Face folder (gpt-oss's released expert weights), found by
`hf_to_dcp` and dequantized as DCP writes them (`titanlab.models.common.mxfp4`).

A packed parameter `P` is stored as `P_blocks` (uint8, (E, rows, G, 16)) and `P_scales` (uint8,
(E, rows, G)); it becomes the titanlab tensor of `P`, (E, G·32, rows), in bf16 unless the import
asks for another dtype. Shapes are checked from the headers before anything is written.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from titanlab.checkpoint.streaming import ConversionError
from titanlab.models.common.mxfp4 import check_mxfp4, dequantize_gpt_oss_experts

_PARTS = ("_blocks", "_scales")


def packed_part(hf_name: str) -> tuple[str, str] | None:
    """(HF name of the packed parameter, "_blocks" or "_scales") for an MXFP4 part, else None."""
    for part in _PARTS:
        if hf_name.endswith(part):
            return hf_name[: -len(part)], part
    return None


class Mxfp4Tensors:
    """The MXFP4 pairs of one folder, by titanlab name."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[str, tuple[str, str, tuple[int, ...]]]] = {}
        self._hf: dict[str, str] = {}

    def add(self, ours: str, hf_base: str, part: str, path: str, hf_name: str, shape) -> None:
        self._parts.setdefault(ours, {})[part] = (path, hf_name, tuple(shape))
        self._hf[ours] = hf_base

    def __contains__(self, ours: str) -> bool:
        return ours in self._parts

    def names(self) -> list[str]:
        return list(self._parts)

    def shape(self, ours: str, expected: tuple[int, ...]) -> tuple[int, ...]:
        """The dequantized shape of `ours`, checked against `expected`.

        Raises:
            ConversionError: one line — a part missing, blocks or scales of a bad shape, or a
                dequantized shape other than `expected`.
        """
        parts, hf = self._parts[ours], self._hf[ours]
        for part in _PARTS:
            if part not in parts:
                raise ConversionError(f"MXFP4 tensor {hf}{part} is missing (its pair is present)")
        blocks, scales = parts["_blocks"][2], parts["_scales"][2]
        try:
            check_mxfp4(hf, blocks, scales)
        except ValueError as e:
            raise ConversionError(str(e)) from None
        if len(blocks) != 4:
            raise ConversionError(f"{hf}: MXFP4 blocks shape {list(blocks)}; need (E, rows, G, 16)")
        shape = (blocks[0], blocks[2] * 32, blocks[1])
        if shape != expected:
            raise ConversionError(
                f"MXFP4 tensor {hf} dequantizes to {list(shape)} but the model expects "
                f"{list(expected)} ({ours})"
            )
        return shape

    def load(self, ours: str, dtype: torch.dtype | None) -> torch.Tensor:
        """The dequantized tensor `ours` in `dtype` (None: bf16)."""
        read = {}
        for part in _PARTS:
            path, hf_name, _ = self._parts[ours][part]
            with safe_open(path, framework="pt") as f:
                read[part] = f.get_tensor(hf_name)
        return dequantize_gpt_oss_experts(
            read["_blocks"], read["_scales"], dtype or torch.bfloat16, name=self._hf[ours]
        )
