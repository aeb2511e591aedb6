"""Sampling completions with the policy module itself: the parameters the optimizer just updated
(FSDP2 shards, TP shards) are the generator's, so there is no weight copy and no second engine.

Prompts may differ in length. Without tensor parallel the rollout decodes through the KV cache
(`titanlab.models.common.kv_cache`): one prefill of the left-padded prompts (each sequence at its
own RoPE positions, padding masked), then one token per forward. Training's tensor-parallel plan
splits activations along the sequence (sequence parallel), which a one-token step cannot split,
so under TP each step re-runs every sequence so far, packed to the left and right-padded to a
multiple of the TP degree (causal attention makes the padding invisible), reading each one's
logits at its own last token. The trainer scores the same packed rows (`Rollout.sequences`).
Every rank runs the same number of forwards (FSDP and TP forwards are collective): decoding
stops when every sequence of every rank has emitted EOS, or after `max_new_tokens`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
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
    """One rollout batch. prompts: (B, P) int64, each left-padded to P; prompt_lens: (B,) int64
    real tokens of each; completions: (B, N) int64, the first stop id after each sequence's
    first stop token; sampler_logp: (B, N) float32 log-probability of each sampled token under
    the sampling temperature (0 after the first stop token)."""

    prompts: torch.Tensor
    completions: torch.Tensor
    sampler_logp: torch.Tensor
    prompt_lens: torch.Tensor | None = None
    width: int = 0  # `sequences()` pads to this many tokens (0: P + N)

    def lens(self) -> torch.Tensor:
        """(B,) int64 prompt lengths (all P when no lengths were given)."""
        if self.prompt_lens is not None:
            return self.prompt_lens
        bs, plen = self.prompts.shape
        return torch.full((bs,), plen, dtype=torch.long, device=self.prompts.device)

    def sequences(self) -> torch.Tensor:
        """Each prompt's real tokens then its completion, packed to the left: (B, W) int64 with
        W = `width` or P + N, right-padded with the completion's last token. Completion token j
        of row b is at position lens[b] + j."""
        seq = torch.cat([self.prompts, self.completions], dim=1)
        packed = pack_left(seq, self.prompts.shape[1] - self.lens())
        extra = self.width - packed.shape[1]
        return F.pad(packed, (0, extra), value=int(seq[0, -1])) if extra > 0 else packed

    def completion_columns(self, per_position: torch.Tensor) -> torch.Tensor:
        """The (B, N) entries of a per-input-position tensor (B, ≥ P + N − 1) of `sequences()`
        (logits' log-probabilities, values) that predict the N completion tokens: row b from
        its prompt's last token on."""
        n = self.completions.shape[1]
        start = self.lens() - 1
        index = start[:, None] + torch.arange(n, device=per_position.device)
        return per_position.gather(1, index)


def pack_left(seq: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Drop the first pad[b] tokens of each row and repeat its last token at the end instead:
    (B, S) -> (B, S)."""
    width = seq.shape[1]
    index = torch.arange(width, device=seq.device)[None, :] + pad[:, None]
    return seq.gather(1, index.clamp(max=width - 1))


def left_pad(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of any lengths as a (B, P) int64 tensor left-padded with 0 (masked by the KV
    cache), and their (B,) lengths."""
    longest = max(len(p) for p in prompts)
    rows = [[0] * (longest - len(p)) + list(p) for p in prompts]
    lens = [len(p) for p in prompts]
    return torch.tensor(rows, device=device), torch.tensor(lens, device=device)


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
    stop_ids: int | Sequence[int],
    tp_degree: int = 1,
    prompt_lens: torch.Tensor | None = None,
) -> Rollout:
    """Sample up to `max_new_tokens` tokens after each of the `prompts` ((B, P) int64 on the
    model's device, left-padded; `prompt_lens` (B,) their real lengths, None: all P) at
    `params.temperature` (greedy when 0), each completion ending at its first token in
    `stop_ids` (the first of them fills the rest).

    Tensor-parallel ranks must pass the same prompts and a generator in the same state: they
    then sample the same tokens from the same logits.
    """
    bs, plen = prompts.shape
    device = prompts.device
    stops = torch.tensor([stop_ids] if isinstance(stop_ids, int) else list(stop_ids), device=device)
    filler = int(stops[0])
    rollout = Rollout(prompts, torch.empty(bs, 0, dtype=torch.long, device=device),
                      torch.empty(bs, 0, device=device), prompt_lens)  # fmt: skip
    lens = rollout.lens()
    completions = torch.full((bs, max_new_tokens), filler, dtype=torch.long, device=device)
    sampler_logp = torch.zeros(bs, max_new_tokens, device=device)
    done = torch.zeros(bs, dtype=torch.bool, device=device)
    temperature = params.temperature if params.temperature > 0 else 1.0
    rows = torch.arange(bs, device=device)
    if tp_degree == 1:
        cache = KVCache(plen - lens, plen + max_new_tokens)
        logits = model(prompts, cache)[:, -1]
    else:
        cache = None
        packed = F.pad(pack_left(prompts, plen - lens), (0, max_new_tokens), value=filler)
        logits = _at(model, packed, lens, tp_degree)
    for t in range(max_new_tokens):
        logits = _full(logits).float()  # (B, V)
        token = sample_next(logits, params, generator)
        token = torch.where(done, filler, token)
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(1, token[:, None])[:, 0]
        completions[:, t] = token
        sampler_logp[:, t] = torch.where(done, 0.0, logp)
        done = done | torch.isin(token, stops)
        if t == max_new_tokens - 1 or not _any_running(done):
            break
        if cache is not None:
            logits = model(token[:, None], cache)[:, -1]
        else:
            packed[rows, lens + t] = token
            logits = _at(model, packed, lens + t + 1, tp_degree)
    return Rollout(prompts, completions, sampler_logp, prompt_lens)


def _at(
    model: nn.Module, packed: torch.Tensor, lengths: torch.Tensor, multiple: int
) -> torch.Tensor:
    """Logits (B, V) at each row's last real token (`lengths`, (B,)) of the left-packed
    `packed`, from a forward without a cache of its first max(lengths) columns right-padded to
    a multiple of `multiple`."""
    width = int(lengths.max())
    pad = -width % multiple
    seq = packed[:, :width]
    logits = _full(model(F.pad(seq, (0, pad), value=0) if pad else seq))  # (B, S, V)
    rows = torch.arange(len(lengths), device=lengths.device)
    return logits[rows, lengths - 1]
