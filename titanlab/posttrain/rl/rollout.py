"""Sampling completions with the policy module itself: the parameters the optimizer just updated
(FSDP2 shards, TP shards) are the generator's, so there is no weight copy and no second engine.

Without tensor parallel the rollout decodes through the KV cache
(`titanlab.models.common.kv_cache`): one prefill of the prompts, then one token per forward.
Training's tensor-parallel plan splits activations along the sequence (sequence parallel),
which a one-token step cannot split, so under TP each step re-runs the whole sequence so far
(right-padded to a multiple of the TP degree; causal attention makes the padding invisible).
Every rank runs the same number of forwards (FSDP and TP forwards are collective): decoding
stops when every sequence of every rank has emitted EOS, or after `max_new_tokens`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titanlab.generation.sampling import SamplingParams, sample_next
from titanlab.models.common.kv_cache import KVCache


@dataclass
class Rollout:
    """One rollout batch. prompts: (B, P) int64; completions: (B, N) int64, EOS after each
    sequence's first EOS; sampler_logp: (B, N) float32 log-probability of each sampled token
    under the sampling temperature (0 after the first EOS)."""

    prompts: torch.Tensor
    completions: torch.Tensor
    sampler_logp: torch.Tensor


def _full(logits: torch.Tensor) -> torch.Tensor:
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def _any_running(done: torch.Tensor) -> bool:
    """Whether any sequence of any rank is still being decoded (one all-reduce)."""
    running = (~done).any().float()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(running, op=dist.ReduceOp.MAX)
    return bool(running.item())


@contextlib.contextmanager
def gathered_weights(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within, with `enabled`: FSDP keeps each module's weights gathered after its first
    forward (one all-gather per module for the whole rollout instead of one per forward);
    after, every FSDP module is resharded and its reshard-after-forward setting restored.

    Resharding only the root would leave the children's weights gathered (plain Parameters,
    not DTensors), hence every module (`../shared/notes/grpo_design.md`, component 3).
    """
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)] if enabled else []
    # FSDP2 has no getter for the setting; a group that reshards after forward keeps the
    # mesh it reshards to (torch 2.13's FSDPParamGroup.post_forward_mesh_info).
    before = []
    for m in modules:
        group = m._get_fsdp_state()._fsdp_param_group
        before.append(group is not None and group.post_forward_mesh_info is not None)
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m, reshard in zip(modules, before):
            m.reshard()
            m.set_reshard_after_forward(reshard, recurse=False)


@torch.no_grad()
def sample_completions(
    model: nn.Module,
    prompts: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator,
    eos_id: int,
    tp_degree: int = 1,
) -> Rollout:
    """Sample up to `max_new_tokens` tokens after each of the equal-length `prompts` ((B, P)
    int64, on the model's device) at `params.temperature` (greedy when 0).

    Tensor-parallel ranks must pass the same prompts and a generator in the same state: they
    then sample the same tokens from the same logits.
    """
    bs, plen = prompts.shape
    device = prompts.device
    completions = torch.full((bs, max_new_tokens), eos_id, dtype=torch.long, device=device)
    sampler_logp = torch.zeros(bs, max_new_tokens, device=device)
    done = torch.zeros(bs, dtype=torch.bool, device=device)
    temperature = params.temperature if params.temperature > 0 else 1.0
    seq = prompts
    if tp_degree == 1:
        cache = KVCache(torch.zeros(bs, dtype=torch.long, device=device), plen + max_new_tokens)
        logits = model(prompts, cache)[:, -1]
    else:
        cache = None
        logits = _last(model, seq, tp_degree)[:, -1]
    for t in range(max_new_tokens):
        logits = _full(logits).float()  # (B, V)
        token = sample_next(logits, params, generator)
        token = torch.where(done, eos_id, token)
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(1, token[:, None])[:, 0]
        completions[:, t] = token
        sampler_logp[:, t] = torch.where(done, 0.0, logp)
        done = done | (token == eos_id)
        if t == max_new_tokens - 1 or not _any_running(done):
            break
        if tp_degree == 1:
            logits = model(token[:, None], cache)[:, -1]
        else:
            seq = torch.cat([seq, token[:, None]], dim=1)
            logits = _last(model, seq, tp_degree)[:, -1]
    return Rollout(prompts, completions, sampler_logp)


def _last(model: nn.Module, seq: torch.Tensor, multiple: int) -> torch.Tensor:
    """Logits of the last real position of `seq`, computed without a cache on `seq` padded on
    the right to a multiple of `multiple`: (B, 1, V)."""
    length = seq.shape[1]
    pad = -length % multiple
    padded = F.pad(seq, (0, pad), value=0) if pad else seq
    return _full(model(padded))[:, length - 1 : length]
