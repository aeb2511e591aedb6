"""The decode loop: left-pad a batch of prompts, prefill the KV cache, then one token per step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from titanlab.generation.mtp_draft import DraftStats, draft_decode
from titanlab.generation.sampling import SamplingParams, sample_next
from titanlab.models.common.kv_cache import KVCache

GREEDY = SamplingParams()


def check_request(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    params: SamplingParams = GREEDY,
    max_seq_len: int | None = None,
    mtp_draft: bool = False,
) -> None:
    """What `generate` refuses, checked before it runs (a command line checks it before it
    prints anything). Raises ValueError (one line): see `generate`."""
    params.validate()
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    limit = max_seq_len or int(cast(torch.Tensor, model.rope_cos).shape[0])
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"a prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds "
            f"max_seq_len={limit}; shorten the prompt or lower max_new_tokens"
        )
    if mtp_draft and getattr(model, "mtp", None) is None:
        raise ValueError(
            f"drafting with multi-token prediction needs a model with MTP depths; "
            f"{type(model).__name__} (mtp_layers=0) has none: decode without the draft"
        )


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    params: SamplingParams = GREEDY,
    eos_ids: Sequence[int] = (),
    seed: int = 0,
    max_seq_len: int | None = None,
    on_step: Callable[[list[int | None]], None] | None = None,
    step_logits: list[torch.Tensor] | None = None,
    mtp_draft: DraftStats | None = None,
    cache_out: list[KVCache] | None = None,
) -> list[list[int]]:
    """Continue each prompt by up to `max_new_tokens` tokens; returns the new tokens per prompt
    (ending with the EOS token when one was produced).

    Args:
        model: a `Decoder` of any family (plain, or tensor-parallel with the same inputs on
            every rank), in eval mode.
        prompts: token ids, of different lengths (left-padded internally).
        eos_ids: tokens that end a sequence (EOS, the chat template's end of turn).
        seed: seeds the sampling generator (same seed, same output; unused when greedy).
        max_seq_len: slots per sequence; default the model's RoPE length (`args.max_seq_len`).
        on_step: called after each decode step with each sequence's new token (None once the
            sequence has ended), for streaming.
        step_logits: when given, receives each step's next-token logits, (bs, vocab) float32.
        mtp_draft: when given, decode self-speculatively with the model's first multi-token
            prediction depth (DeepSeek-V3; `titanlab.generation.mtp_draft`), counting its drafts
            into this `DraftStats`: the same output in fewer main-model forwards.
        cache_out: when given, receives the decode's `KVCache` (its `kv_bytes` and
            `recurrent_bytes` after the last step).

    Raises:
        ValueError: an empty prompt, `max_new_tokens < 1`, bad sampling parameters, a prompt
            longer than `max_seq_len - max_new_tokens` (one line naming the lengths), or
            `mtp_draft` for a model without MTP depths.
    """
    check_request(model, prompts, max_new_tokens, params, max_seq_len, mtp_draft is not None)
    rope_cos = cast(torch.Tensor, model.rope_cos)
    longest = max(len(p) for p in prompts)
    device = rope_cos.device
    bs = len(prompts)
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    tokens = torch.zeros(bs, longest, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, longest - len(p) :] = torch.tensor(list(p), dtype=torch.long)
    generator = torch.Generator(device=device).manual_seed(seed)
    eos = set(eos_ids)
    out: list[list[int]] = [[] for _ in range(bs)]
    done = [False] * bs

    def emit(nxt: torch.Tensor, logits: torch.Tensor) -> bool:
        """Append each unfinished sequence's new token; True when every one has ended."""
        if step_logits is not None:
            step_logits.append(logits)
        new: list[int | None] = []
        for b, t in enumerate(nxt.tolist()):
            new.append(None if done[b] else t)
            if not done[b]:
                out[b].append(t)
                done[b] = t in eos
        if on_step is not None:
            on_step(new)
        return all(done)

    if mtp_draft is not None:
        draft_decode(model, tokens, pad, max_new_tokens, params, generator, emit, done, mtp_draft)
        return out
    cache = KVCache(pad, longest + max_new_tokens)
    if cache_out is not None:
        cache_out.append(cache)
    logits = model(tokens, cache)[:, -1].float()  # (bs, vocab)
    for step in range(max_new_tokens):
        nxt = sample_next(logits, params, generator)  # (bs,)
        if emit(nxt, logits) or step == max_new_tokens - 1:
            break
        logits = model(nxt[:, None], cache)[:, -1].float()
    return out
