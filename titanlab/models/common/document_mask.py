"""Document masking: attention that stays inside each document of a packed window.

A training window cut from the token stream holds the end of one document, whole documents and
the start of another, separated by EOS tokens. With document masking, token i attends to token
j only when j <= i and both belong to the same document (block-causal attention), and
optionally each document's RoPE positions restart at 0, so a window behaves as if each of its
documents ran alone. An EOS token belongs to the document it ends; the next token starts a new
document. (Used by OLMo-core and Megatron-Core as "document masking" / "reset attention mask";
Llama 3 pre-training masks attention across documents the same way: Llama 3 paper, section 3.4.)

The model gets the per-token document index (`segments`) and, for restarted positions,
`positions`; `Decoder` builds the mask once per forward. On CUDA it is flex attention's
`BlockMask` (blocks without any allowed pair are skipped); elsewhere a dense boolean mask for
SDPA (flex attention has no CPU backward).
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per-token document index of each window: the number of EOS tokens strictly before it.

    Args:
        tokens: (bs, seq) int64 token ids.
        eos_id: the end-of-document token.
    Returns:
        (bs, seq) int64, 0 for the window's first document, non-decreasing along seq.
    """
    is_eos = (tokens == eos_id).to(torch.int64)
    return torch.cumsum(is_eos, dim=1) - is_eos


def document_positions(segments: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document (restarting at 0 at every document start).

    Args:
        segments: (bs, seq) int64 from `document_ids` (non-decreasing along seq).
    Returns:
        (bs, seq) int64.
    """
    seq = segments.shape[1]
    index = torch.arange(seq, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index))
    return index - torch.cummax(first, dim=1).values


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


def build_attention_mask(segments: torch.Tensor):
    """The mask `Attention` takes for `segments`: a flex `BlockMask` on CUDA, else the dense
    boolean mask of `block_causal_mask`."""
    if segments.device.type == "cuda":
        return flex_block_mask(segments)
    return block_causal_mask(segments)


def cross_document_labels_ignored(
    inputs: torch.Tensor, labels: torch.Tensor, eos_id: int, ignore_index: int
) -> torch.Tensor:
    """`labels` with `ignore_index` where the input is EOS: the next-token target of a
    document's last token is the next document's first token, a prediction across documents
    that running each document alone never makes. Shapes (bs, seq); returns a new tensor."""
    return labels.masked_fill(inputs == eos_id, ignore_index)
