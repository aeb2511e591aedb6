"""Per-rank state stored as plain data: JSON text in a uint8 tensor.

DCP writes a non-tensor value with `torch.save` and reads it back with `torch.load(...,
weights_only=False)`, an unpickling that can run code from a checkpoint someone hands you. The
data-loader position is therefore stored as a uint8 tensor holding UTF-8 JSON: DCP copies tensor
bytes without unpickling, and reading it back is `json.loads`, which cannot execute anything.
"""

from __future__ import annotations

import json
from typing import Any

import torch


def encode(state: dict[str, Any]) -> torch.Tensor:
    """`state` (nested dicts/lists of str, int, float, bool, None) as a 1-D uint8 tensor of its
    JSON text. Raises ValueError when it holds anything JSON would not give back unchanged
    (tuples, bytes, non-string keys, objects)."""
    try:
        text = json.dumps(state, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"state is not plain JSON data: {e}") from None
    if json.loads(text) != state:
        raise ValueError("state does not survive a JSON round trip (tuples or non-string keys?)")
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def decode(tensor: torch.Tensor) -> dict[str, Any]:
    """The dict `encode` stored in `tensor`. Raises ValueError when the bytes are not UTF-8 JSON
    of a dict."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ValueError(
            f"expected a 1-D uint8 tensor, got {tensor.dtype} of shape {tuple(tensor.shape)}"
        )
    try:
        state = json.loads(bytes(tensor.tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not JSON text ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise ValueError(f"JSON of a {type(state).__name__}, expected an object")
    return state
