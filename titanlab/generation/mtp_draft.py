"""Self-speculative decoding with a model's first multi-token prediction depth (DeepSeek-V3).

The DeepSeek-V3 report (arXiv:2412.19437, §2.2 and §5.4.3) repurposes its MTP module for
speculative decoding: with the main model's state at position i and the token it chose for
i + 1, the depth guesses the token at i + 2 (85-90% accepted, 1.8× tokens per second there).
Here the guess is checked the usual way (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", arXiv:2211.17192, with a one-token draft): the main
model runs on [next token, draft] in one forward; the token it picks at the first of those
positions is emitted, and when it equals the draft (in every unfinished sequence of the batch),
the token it picks at the second is emitted too. Otherwise the draft's cache slot is dropped.

Each emitted token is drawn from the main model's own distribution at its position, with one
draw of the sampling generator per emitted token in order, so the output equals plain decoding
(`generate` without a draft) token for token, greedy or sampled with the same seed; the draft
only changes how many main-model forwards it takes. The depth keeps its own KV cache, one slot
per position whose next token is known, in step with the main model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titanlab.generation.sampling import SamplingParams, sample_next
from titanlab.models.common.kv_cache import KVCache


@dataclass
class DraftStats:
    """What drafting did: `drafted` main-model forwards carried a draft, `accepted` of them
    emitted it; `forwards` counts every main-model forward after the prefill and `emitted` the
    tokens emitted per sequence (prefill's included: tokens per forward is emitted over
    forwards + 1)."""

    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    emitted: int = 0

    @property
    def acceptance(self) -> float:
        """Accepted drafts over drafted forwards (0 without a draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0


def draft_tokens(model: Any, h: torch.Tensor, index: int) -> torch.Tensor:
    """The depth's guess (greedy) from its output `h` ((bs, dim), the latest position): (bs,)
    int64, for each sequence's output token number `index` (0-based; unused here, a test swaps
    this function for one that knows the answer)."""
    return model.output(h).float().argmax(dim=-1)


class _LastNormOutput:
    """Keeps the main model's final-norm output, (bs, seq, dim), from each forward."""

    def __init__(self, norm: nn.Module) -> None:
        self.value: torch.Tensor | None = None
        self.handle = norm.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.value = output


@torch.no_grad()
def draft_decode(
    model: Any,
    tokens: torch.Tensor,
    pad: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator,
    emit: Callable[[torch.Tensor, torch.Tensor], bool],
    done: list[bool],
    stats: DraftStats,
) -> None:
    """Decode `tokens` ((bs, prompt_len) int64, left-padded by `pad`) for up to
    `max_new_tokens` tokens, drafting with `model.mtp["0"]`. `emit(next_tokens, logits)` takes
    each emitted step ((bs,) int64, (bs, vocab) fp32), updates `done` (per sequence) and
    returns whether every sequence has ended."""
    depth = model.mtp["0"]
    cache = KVCache(pad, tokens.shape[1] + max_new_tokens)
    depth_cache = KVCache(pad, tokens.shape[1] + max_new_tokens)
    hidden = _LastNormOutput(model.norm)
    emitted = 0

    def take(logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
        nonlocal emitted
        token = sample_next(logits, params, generator)
        emitted += 1
        return token, emit(token, logits) or emitted == max_new_tokens

    try:
        nxt, stop = take(model(tokens, cache)[:, -1].float())
        # the main model's states at the positions the depth has not seen, and the next token
        # of each of them but the last (whose next token is `nxt`, not yet in the main cache)
        assert hidden.value is not None
        pending, pending_next = hidden.value, tokens[:, 1:]
        while not stop:
            drafting = emitted + 2 <= max_new_tokens
            step = nxt[:, None]
            if drafting:
                stats.drafted += 1
                next_tokens = torch.cat((pending_next, nxt[:, None]), 1)
                state = _depth(model, depth, depth_cache, pending, next_tokens)
                guess = draft_tokens(model, state[:, -1], emitted)
                step = torch.stack((nxt, guess), 1)
            out = model(step, cache).float()  # (bs, 1 or 2, vocab)
            stats.forwards += 1
            assert hidden.value is not None
            pending, pending_next = hidden.value, nxt.new_empty((nxt.shape[0], 0))
            nxt, stop = take(out[:, 0])
            if stop or not drafting:
                continue
            active = torch.tensor([not d for d in done], device=nxt.device)
            if bool(((nxt == guess) | ~active).all()):  # the draft's slot is right: use it
                stats.accepted += 1
                pending_next = nxt[:, None]
                nxt, stop = take(out[:, 1])
            else:  # drop the draft's slot; `nxt` goes in next time
                cache.truncate(cache.length - 1)
                pending = pending[:, :1]
    finally:
        hidden.handle.remove()
        stats.emitted += emitted


def _depth(
    model: Any, depth: nn.Module, cache: KVCache, h: torch.Tensor, next_tokens: torch.Tensor
) -> torch.Tensor:
    """Run the depth over the main model's new positions: `h` (bs, n, dim) their final-norm
    states, `next_tokens` (bs, n) the token after each; returns its states (bs, n, dim)."""
    positions = cache.begin(h.shape[1])
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    out = depth(h, model.tok_embeddings(next_tokens), cos, sin, kv=cache.layer(0))
    cache.end()
    return out
