"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Top-p keeps the smallest set of most likely tokens whose probabilities sum to at least p
(Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"); top-k keeps the k most
likely. Both apply after the temperature, top-k first, as in Hugging Face's `generate`.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature: 0 for greedy (argmax), else logits ÷ temperature before sampling;
    top_k: keep the k most likely tokens (0: all); top_p: nucleus mass in (0, 1] (1: all).

    Raises (from `validate`):
        ValueError: a value out of range, in one line naming it and the valid range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0: no top-k)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1: no top-p)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits: (bs, vocab), any float dtype → the next token of each row, (bs,) int64.
    Sampling draws from `generator` (seeded by the caller for reproducible output)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]  # (bs, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        ordered = ordered.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
