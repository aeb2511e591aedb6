"""Segment ids and positions of packed windows: which document each token belongs to, its
position inside that document, and labels that do not cross documents.

The model's side of document masking (the block-causal mask built from these segment ids) is
`titanlab.models.common.document_mask`; see its docstring for the recipe and its sources.
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


def cross_document_labels_ignored(
    inputs: torch.Tensor, labels: torch.Tensor, eos_id: int, ignore_index: int
) -> torch.Tensor:
    """`labels` with `ignore_index` where the input is EOS: the next-token target of a
    document's last token is the next document's first token, a prediction across documents
    that running each document alone never makes. Shapes (bs, seq); returns a new tensor."""
    return labels.masked_fill(inputs == eos_id, ignore_index)
