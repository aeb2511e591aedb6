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
allgather: k and v gathered forward, their gradients reduced backward; ring alltoall: k and v
sent cp−1 times forward and again backward, their gradients cp times; Ulysses: q, k, v and
the output through an all-to-all forward, their gradients backward (exact byte counts:
tools/lib/cp_bench.py `closed_form_bytes`, checked by the communication counter).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from titanlab.distributed.cp_balance import shard_order
from titanlab.distributed.cp_collectives import (
    shift,
    gather_sequence,
    gather_values,
    heads_to_sequence,
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
        assert self.mask is not None
        return _RingAttention.apply(q, k, v, self.mask, scale, self.group)


def _block(q, k, mask, scale: float) -> torch.Tensor:
    """fp32 scores of q (bs, H, Sq, d) against one key shard k (bs, H, Sk, d), disallowed
    pairs at -1e30 (finite: a shard with no allowed key gets weight exp(-1e30 - lse) = 0)."""
    return (q.float() @ k.float().transpose(-1, -2) * scale).masked_fill(~mask, -1e30)


class _RingAttention(torch.autograd.Function):
    """Ring attention with the `alltoall` rotation: the key/value shards travel the ring one
    step at a time; forward merges the partial softmaxes by their log-sum-exp and keeps only
    q, this rank's k and v, the output and the log-sum-exp (bs, H, S/cp); backward travels the
    ring again, recomputing each shard's probabilities from the saved log-sum-exp (the
    FlashAttention-2 backward, Dao 2023, arXiv:2307.08691, per shard), and the shards' key and
    value gradients travel with them and come home after a last step. fp32 inside."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale: float, group):
        import torch.distributed as dist

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local = q.shape[2]
        kj, vj = k, v
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], -1e30, dtype=torch.float32, device=q.device)
        for step in range(world):
            if step:
                kj, vj = shift(kj, 1, group), shift(vj, 1, group)
            src = (rank - step) % world
            scores = _block(q, kj, mask[..., src * local : (src + 1) * local], scale)
            block_lse = torch.logsumexp(scores, dim=-1)
            merged = torch.logaddexp(lse, block_lse)
            out = (
                out * torch.exp(lse - merged)[..., None]
                + torch.exp(scores - merged[..., None]) @ vj.float()
            )
            lse = merged
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.scale, ctx.group = scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        import torch.distributed as dist

        q, k, v, mask, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        local = q.shape[2]
        do = grad_out.float()
        delta = (do * out).sum(-1, keepdim=True)  # (bs, H, S/cp, 1)
        dq = torch.zeros_like(q, dtype=torch.float32)
        kj, vj = k, v
        dkj = torch.zeros_like(k, dtype=torch.float32)
        dvj = torch.zeros_like(v, dtype=torch.float32)
        for step in range(world):
            if step:
                kj, vj = shift(kj, 1, group), shift(vj, 1, group)
                dkj, dvj = shift(dkj, 1, group), shift(dvj, 1, group)
            src = (rank - step) % world
            p = torch.exp(_block(q, kj, mask[..., src * local : (src + 1) * local], scale)
                          - lse[..., None])  # fmt: skip
            dvj = dvj + p.transpose(-1, -2) @ do
            ds = p * (do @ vj.float().transpose(-1, -2) - delta)
            dq = dq + ds @ kj.float() * scale
            dkj = dkj + ds.transpose(-1, -2) @ q.float() * scale
        dk, dv = shift(dkj, 1, group), shift(dvj, 1, group)  # home: one more step
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


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


def own_cp_attention(config) -> bool:
    """Whether a run (`config` a JobConfig) may train through this module's attention: cp > 1
    with Ulysses, a document mask, or packing on (chat SFT data packs with a document mask;
    whether the data are chat is the data layer's to say, so a packed causal run counts too).
    The trainer then compiles its blocks around the attention call."""
    data, par = config.data, config.parallelism
    if par.context_parallel_degree <= 1:
        return False
    return par.context_parallel_mode == "ulysses" or data.document_mask or data.packing
