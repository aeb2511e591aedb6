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
`positions`; `Decoder` builds the mask once per forward. On CUDA it is flex attention's
`BlockMask` (blocks without any allowed pair are skipped); elsewhere a dense boolean mask for
SDPA (flex attention has no CPU backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

# A builder that replaces the masks below for one context (context parallel's attention,
# `titanlab.distributed.cp_documents`): called with (segments, positions) of the tokens the
# forward holds, it returns an object whose `attend(q, k, v, scale)` `Attention` calls.
_BUILDER: ContextVar[Callable[[torch.Tensor, torch.Tensor | None], Any] | None] = ContextVar(
    "titanlab_attention_mask_builder", default=None
)


@contextlib.contextmanager
def mask_builder(build: Callable[[torch.Tensor, torch.Tensor | None], Any]) -> Iterator[None]:
    """Within: `build_attention_mask(segments, positions)` returns `build(segments,
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


def flex_block_mask(segments: torch.Tensor):
    """flex attention's `BlockMask` of the same block-causal pattern (CUDA; compiled).

    Args:
        segments: (bs, seq) int64 document indices.
    Returns:
        a `torch.nn.attention.flex_attention.BlockMask` for (bs, any heads, seq, seq).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (segments[b, q] == segments[b, kv])

    bs, seq = segments.shape
    return create_block_mask(mask_mod, bs, None, seq, seq, device=segments.device)


def build_attention_mask(segments: torch.Tensor, positions: torch.Tensor | None = None):
    """The mask `Attention` takes for `segments` (bs, seq): a flex `BlockMask` on CUDA, else
    the dense boolean mask of `block_causal_mask`; inside `mask_builder`, its builder's object
    (which also gets the tokens' `positions`, (bs, seq) int64 or None)."""
    build = _BUILDER.get()
    if build is not None:
        return build(segments, positions)
    if segments.device.type == "cuda":
        return flex_block_mask(segments)
    return block_causal_mask(segments)
