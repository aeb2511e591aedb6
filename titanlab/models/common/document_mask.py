"""Document masking: attention that stays inside each document of a packed window.

A training window cut from the token stream holds the end of one document, whole documents and
the start of another, separated by EOS tokens. With document masking, token i attends to token
j only when j <= i and both belong to the same document (block-causal attention), and
optionally each document's RoPE positions restart at 0, so a window behaves as if each of its
documents ran alone. An EOS token belongs to the document it ends; the next token starts a new
document. (Used by OLMo-core and Megatron-Core as "document masking" / "reset attention mask";
Llama 3 pre-training masks attention across documents the same way: Llama 3 paper, section 3.4.)

The data pipeline computes the per-token document index (`segments`, `titanlab.data.segments`);
the model gets it and, for restarted positions,
`positions`; `Decoder` builds the masks once per forward (`attention_masks`). On CUDA each is a
FlexAttention `BlockMask` (tiles without any allowed pair are skipped); elsewhere a dense
boolean mask for SDPA (FlexAttention has no CPU backward in torch 2.13).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from titanlab.config.device_path import device_type
from titanlab.models.common.flex_masks import (
    TILES,
    band_block_mask,
    document_block_mask,
    kind_of,
)

# A builder that replaces the masks below for one context (context parallel's attention,
# `titanlab.distributed.context_parallel.documents`): called with (segments, positions) of the
# tokens the forward holds, it returns an object whose `attend(q, k, v, scale)` `Attention` calls.
_BUILDER: ContextVar[Callable[[torch.Tensor, torch.Tensor | None], Any] | None] = ContextVar(
    "titanlab_attention_mask_builder", default=None
)


@contextlib.contextmanager
def mask_builder(build: Callable[[torch.Tensor, torch.Tensor | None], Any]) -> Iterator[None]:
    """Within: `attention_masks(segments, positions, ...)` gives every layer `build(segments,
    positions)`, an object with `attend(q, k, v, scale=None)` over (bs, heads, seq, d)."""
    token = _BUILDER.set(build)
    try:
        yield
    finally:
        _BUILDER.reset(token)


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """Dense SDPA mask: True where query i may attend key j (j <= i, same document).

    Args:
        segments: (bs, seq) int64 document indices.
    Returns:
        (bs, 1, seq, seq) bool, broadcast over heads.
    """
    seq = segments.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    return (same & causal)[:, None]


def attention_masks(
    segments: torch.Tensor | None,
    positions: torch.Tensor | None,
    windows: Iterable[int | None],
    local: bool,
    seq: int,
    device: torch.device,
) -> dict[int | None, Any] | None:
    """The mask each attention layer takes, by its window (None: full causal): the one place
    that chooses the attention kernel, by the device's code path (`device_type`: the ledger's
    target when it prices a GPU step).

    - Inside `mask_builder` (context parallel's attention) with documents: its object, for every
      window.
    - CUDA, with documents (`segments` (bs, seq) int64, `positions` (bs, seq) int64 or None) or
      local attention (`local`: a window or sinks in some layer): a FlexAttention `BlockMask`
      per window (`titanlab.models.common.flex_masks`), built tile by tile (no seq × seq
      tensor); `Attention` and `MLA` run them through `flex_kernel.flex_attend`.
    - Elsewhere (CPU: FlexAttention has no CPU backward in torch 2.13): with documents, the
      dense boolean SDPA mask of `block_causal_mask` for every window (the sliding window's
      chunked SDPA combines it with the band); without, None (causal SDPA, or the local path).
    """
    windows = set(windows)
    build = _BUILDER.get()
    if segments is not None and build is not None:
        return dict.fromkeys(windows, build(segments, positions))
    if device_type(device) == "cuda" and (segments is not None or local):
        masks = {}
        for w in windows:
            if segments is None:
                masks[w] = band_block_mask(seq, seq, w, device)
            else:
                pos = positions if positions is not None else torch.arange(seq, device=device)
                pos = pos.expand_as(segments)
                masks[w] = document_block_mask(segments, pos, segments, pos, w)
            TILES.add(kind_of(w), masks[w])
        return masks
    if segments is not None:
        return dict.fromkeys(windows, block_causal_mask(segments))
    return None
