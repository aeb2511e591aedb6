"""Document masking of training batches (`data.document_mask`, `data.reset_positions`).

The trainer hands each (inputs, labels) batch to `DocumentMasking.apply`, which returns the
labels without cross-document targets and the keyword arguments the model takes
(`segments`, and `positions` when they restart per document); the mechanism itself is in
`titanlab.data.segments` (segment ids) and
`titanlab.models.common.document_mask` (the mask the model builds from them). Chat SFT packing uses the same keywords.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from titanlab.data.labels import IGNORE_INDEX
from titanlab.data.segments import (
    cross_document_labels_ignored,
    document_ids,
    document_positions,
)

_SCAN_TOKENS = 1 << 24  # how much of the stream the pre-flight reads looking for an EOS


@dataclass(frozen=True)
class DocumentMasking:
    """eos_id: the token that ends a document in the data; reset_positions: restart RoPE
    positions at each document's first token."""

    eos_id: int
    reset_positions: bool = False

    def apply(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """(labels, model kwargs) of a (bs, seq) batch: the labels of EOS inputs ignored
        (`IGNORE_INDEX`), `segments` (bs, seq) int64 and, with `reset_positions`, `positions`."""
        segments = document_ids(inputs, self.eos_id)
        kwargs: dict[str, Any] = {"segments": segments}
        if self.reset_positions:
            kwargs["positions"] = document_positions(segments)
        return cross_document_labels_ignored(inputs, labels, self.eos_id, IGNORE_INDEX), kwargs


def first_eos_offset(dataset: Any, eos_id: int, limit: int = _SCAN_TOKENS) -> int | None:
    """Offset of the first `eos_id` in the first `limit` tokens of a `MemmapTokenDataset`'s
    stream, or None when there is none."""
    n = min(dataset.total_tokens, limit)
    chunk = 1 << 20
    for start in range(0, n, chunk):
        hits = np.flatnonzero(dataset.read_tokens(start, min(n, start + chunk)) == eos_id)
        if hits.size:
            return start + int(hits[0])
    return None
