"""titanlab's own context-parallel attention: document masks (packed pretraining windows and
packed chat SFT samples) under ring CP, and Ulysses CP for any mask.

PyTorch's `context_parallel` (`titanlab.distributed.context_parallel`) runs causal SDPA round
the ring; it takes no other mask on this torch (its FlexAttention path all-gathers keys and
values, but FlexAttention has no backward on CPU). This module covers the rest:

- The batch is sharded here, before the model: `shard_batch` gives each cp rank its tokens
  (`titanlab.distributed.cp_balance` chooses which, balancing the mask's work), with their
  labels (masked prompt tokens stay masked), document ids and RoPE positions (restarted per
  document when the data says so, else the token's index in the window).
- Inside the model the document mask is built from ids and positions, not from indices: query
  i may attend key j when both are in the same document and position_j ≤ position_i (positions
  grow inside a document), so any order of the tokens over the ranks gives the right mask.
  The model's `build_attention_mask` hook (`titanlab.models.common.document_mask`) returns a
  `ContextParallelAttention` that each attention layer calls instead of SDPA (`attend`).
- `mode = "ring"`: each rank attends its queries to every key. `rotate = "allgather"`: the
  keys and values are all-gathered once per layer and one SDPA call with the rank's
  (S/cp × S) mask runs; `rotate = "alltoall"`: they travel the ring one shard at a time (cp
  steps of a point-to-point shift) and the partial softmaxes merge by their log-sum-exp (Liu
  et al. 2023, "Ring Attention", arXiv:2310.01889), in fp32.
- `mode = "ulysses"`: DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509): an all-to-all
  turns (bs, H, S/cp, d) sequence shards of q, k and v into (bs, H/cp, S, d) head shards, the
  rank attends its heads over the whole sequence with the whole mask (causal SDPA without
  documents), and a second all-to-all turns the output back. Heads must divide by tp × cp.

Bytes a rank sends per layer and microbatch, q/k/v/o each (bs, H, S/cp, d) of b bytes: ring
allgather 2·(cp−1)·n·b forward (k, v), as much back; ring alltoall the same in cp−1 shifts;
Ulysses 4·(cp−1)/cp·n·b forward (q, k, v, out), as much back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from titanlab.distributed.cp_balance import shard_order
from titanlab.distributed.cp_collectives import (
    gather_sequence,
    gather_values,
    heads_to_sequence,
    ring_shift,
    sequence_to_heads,
)
from titanlab.models.common.document_mask import mask_builder

MODES = ("ring", "ulysses")


def allowed(
    seg_q: torch.Tensor, pos_q: torch.Tensor, seg_k: torch.Tensor, pos_k: torch.Tensor
) -> torch.Tensor:
    """(bs, 1, Sq, Sk) bool: query i may attend key j (same document, position_j ≤ position_i).
    seg_*, pos_*: (bs, S*) int64."""
    same = seg_q[:, :, None] == seg_k[:, None, :]
    return (same & (pos_k[:, None, :] <= pos_q[:, :, None]))[:, None]


class ContextParallelAttention:
    """The attention of one forward under titanlab's CP, built once per forward from this
    rank's document ids and positions (bs, S/cp) by the model's mask hook.

    Args:
        segments, positions: (bs, S/cp) int64, this rank's tokens'.
        group: the cp process group. mode: ring | ulysses. rotate: allgather | alltoall (ring).
        causal: no documents (one per row) in index order: Ulysses then runs causal SDPA.
    """

    def __init__(
        self, segments: torch.Tensor, positions: torch.Tensor, group, mode: str, rotate: str,
        causal: bool = False,
    ) -> None:  # fmt: skip
        self.group, self.mode, self.rotate = group, mode, rotate
        seg_all, pos_all = gather_values(segments, 1, group), gather_values(positions, 1, group)
        if mode == "ring":
            self.mask: torch.Tensor | None = allowed(segments, positions, seg_all, pos_all)
        else:
            self.mask = None if causal else allowed(seg_all, pos_all, seg_all, pos_all)

    @torch.compiler.disable  # collectives inside: the compiled block breaks its graph here
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        """softmax(q kᵀ · scale + mask) v for q, k (bs, H, S/cp, d) and v (bs, H, S/cp, dv) of
        this rank's tokens; returns (bs, H, S/cp, dv) in q's dtype."""
        if self.mode == "ulysses":
            q, k, v = (sequence_to_heads(t, self.group) for t in (q, k, v))
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=self.mask, is_causal=self.mask is None, scale=scale
            )
            return heads_to_sequence(out, self.group)
        if self.rotate == "allgather":
            k, v = gather_sequence(k, 2, self.group), gather_sequence(v, 2, self.group)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale)
        return self._ring(q, k, v, scale if scale is not None else 1 / math.sqrt(q.shape[-1]))

    def _ring(self, q, k, v, scale: float) -> torch.Tensor:
        """cp steps: attend to the key/value shard in hand, pass it on; merge by log-sum-exp."""
        import torch.distributed as dist

        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        assert self.mask is not None
        local = q.shape[2]
        outs, lses = [], []
        qf = q.float() * scale
        for step in range(world):
            if step:
                k, v = ring_shift(k, self.group), ring_shift(v, self.group)
            src = (rank - step) % world
            mask = self.mask[..., src * local : (src + 1) * local]
            # A finite fill: a shard with no allowed key gets weight exp(-1e30 - lse) = 0.
            scores = (qf @ k.float().transpose(-1, -2)).masked_fill(~mask, -1e30)
            lse = torch.logsumexp(scores, dim=-1)  # (bs, H, S/cp)
            outs.append(torch.softmax(scores, dim=-1) @ v.float())
            lses.append(lse)
        total = torch.logsumexp(torch.stack(lses), dim=0)
        out = sum(torch.exp(l - total)[..., None] * o for l, o in zip(lses, outs))
        return out.to(q.dtype)


def shard_batch(
    inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict, cp: int, rank: int, mode: str,
    balancer: str,
) -> tuple[torch.Tensor, torch.Tensor, dict]:  # fmt: skip
    """This cp rank's share of a (bs, S) batch: its tokens, labels, and the model keywords
    `segments` and `positions` (bs, S/cp), whatever `kwargs` held (none: one causal document
    per row, positions the indices). Ring picks the tokens with `balancer`; Ulysses takes
    contiguous shards (each rank attends all tokens for its heads: nothing to balance)."""
    bs, seq = inputs.shape
    segments, positions = kwargs.get("segments"), kwargs.get("positions")
    order = shard_order(segments, seq, bs, cp, "none" if mode == "ulysses" else balancer)
    mine = order[:, rank * (seq // cp) : (rank + 1) * (seq // cp)].to(inputs.device)
    if segments is None:
        segments = torch.zeros_like(inputs)
    if positions is None:
        positions = torch.arange(seq, device=inputs.device).expand(bs, seq)
    rest = {k: v for k, v in kwargs.items() if k not in ("segments", "positions")}
    local = {"segments": segments.gather(1, mine), "positions": positions.gather(1, mine)}
    return inputs.gather(1, mine), labels.gather(1, mine), {**rest, **local}


def cp_attention(group, mode: str, rotate: str, documents: bool):
    """A context inside which the model's document-mask hook returns a
    `ContextParallelAttention` (one per forward) for this rank's ids and positions."""
    causal = not documents

    def build(segments: torch.Tensor, positions: torch.Tensor | None):
        if positions is None:
            raise ValueError("context parallel attention needs each token's position")
        return ContextParallelAttention(segments, positions, group, mode, rotate, causal)

    return mask_builder(build)


def needs_own_cp(mode: str, kwargs: dict) -> bool:
    """Whether a batch goes through this module rather than PyTorch's causal ring: Ulysses
    always, ring when the batch has a document mask (`segments`)."""
    return mode == "ulysses" or kwargs.get("segments") is not None
