"""titanlab's own context-parallel attention: document masks (packed pretraining windows and
packed chat SFT samples), sliding windows and attention sinks (gpt-oss) under ring CP, and
Ulysses CP for any mask.

PyTorch's `context_parallel` (`titanlab.distributed.context_parallel.torch_sdpa`) runs causal SDPA
round the ring and takes no other mask. torch 2.13's FlexAttention context parallel (the
`_ContextParallel` FLEX style: keys and values all-gathered by `cplib::flex_cp_allgather`, the
mask from `_create_cp_block_mask`, a compiled `create_block_mask` over the load balancer's
rearranged indices) is this module's ring `allgather` on CUDA; titanlab keeps its own because
its masks read each token's document id and position rather than its index (any balancer's
order, `work` included, needs no rewritten mask_mod, and no S divisible by cp·128), build tile
by tile without compiling (`titanlab.models.common.flex_masks`: the ledger prices them), and the
same masks serve the `alltoall` rotation and Ulysses, which torch's FlexAttention CP lacks.

- The batch is sharded here, before the model: `shard_batch` gives each cp rank its tokens
  (`titanlab.distributed.context_parallel.balance` chooses which, balancing the mask's work), with
  their labels (masked prompt tokens stay masked), document ids and RoPE positions (restarted per
  document when the data says so, else the token's index in the window).
- Inside the model the mask is built from ids and positions, not from indices: query i may
  attend key j when both are in the same document and position_j ≤ position_i (positions
  grow inside a document), and within a window of W when position_i − position_j < W, so any
  order of the tokens over the ranks gives the right mask. The model's mask hook
  (`titanlab.models.common.document_mask`) returns a `ContextParallelAttention` that each
  attention layer calls instead of its kernel (`attend`, with its window and sinks).
- The kernel, by the device's code path (`device_type`): on CUDA FlexAttention with block
  masks (no S/cp × S tensor), the sinks through its log-sum-exp
  (`titanlab.models.common.flex_kernel`); elsewhere SDPA with a dense (S/cp × S) bool mask,
  the sinks as one more key (`titanlab.models.common.local_attention.attend`).
- `mode = "ring"`: each rank attends its queries to every key. `rotate = "allgather"`: the
  keys and values are all-gathered once per layer and one attention call runs; `rotate =
  "alltoall"`: they travel the ring one shard at a time and the partial softmaxes merge by
  their log-sum-exp (`titanlab.distributed.context_parallel.ring`).
- `mode = "ulysses"`: DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509): an all-to-all
  turns (bs, H, S/cp, d) sequence shards of q, k and v into (bs, H/cp, S, d) head shards, the
  rank attends its heads (and their sinks) over the whole sequence with the whole mask (causal
  SDPA without documents or window), and a second all-to-all turns the output back. Heads must
  divide by tp × cp.

Bytes a rank sends per layer and microbatch, q/k/v/o each (bs, H, S/cp, d) of b bytes: ring
allgather: k and v gathered forward, their gradients reduced backward; ring alltoall: k and v
sent cp−1 times forward and again backward, their gradients cp times; Ulysses: q, k, v and
the output through an all-to-all forward, their gradients backward (exact byte counts:
tools/lib/cp_bench.py `closed_form_bytes`, checked by the communication counter).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titanlab.config.device_path import device_type
from titanlab.distributed.context_parallel.balance import shard_order
from titanlab.distributed.context_parallel.collectives import (
    gather_sequence,
    gather_values,
    heads_to_sequence,
    sequence_to_heads,
)
from titanlab.distributed.context_parallel.linear import SequenceCarry
from titanlab.distributed.context_parallel.ring import flex_ring_attention, ring_attention
from titanlab.models.common.document_mask import mask_builder
from titanlab.models.common.flex_kernel import flex_attend, with_sinks
from titanlab.models.common.flex_masks import TILES, band_fraction, document_block_mask, kind_of
from titanlab.models.common.local_attention import attend as attend_with_sinks
from titanlab.models.common.local_attention import band_mask

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
    rank's document ids and positions (bs, S/cp) by the model's mask hook; each layer's mask
    (by its window) is built on its first use and kept for the others.

    Args:
        segments, positions: (bs, S/cp) int64, this rank's tokens'.
        group: the cp process group. mode: ring | ulysses. rotate: allgather | alltoall (ring).
        causal: no documents (one per row) in index order: Ulysses then runs causal SDPA.
    """

    def __init__(
        self, segments: torch.Tensor, positions: torch.Tensor, group, mode: str, rotate: str,
        causal: bool = False,
    ) -> None:  # fmt: skip
        self.group, self.mode, self.rotate, self.causal = group, mode, rotate, causal
        self.mine = (segments, positions)
        self.all = (gather_values(segments, 1, group), gather_values(positions, 1, group))
        self._masks: dict[tuple[int | None, bool], Any] = {}
        self._carry: SequenceCarry | None = None

    @property
    def recurrent_carry(self) -> SequenceCarry:
        """What linear-attention layers run through
        (`titanlab.distributed.context_parallel.linear`), built on first use: models without them
        never sort the positions."""
        if self._carry is None:
            self._carry = SequenceCarry(self.mine[1], self.all[1], self.group)
        return self._carry

    def _queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mine if self.mode == "ring" else self.all

    def mask(self, window: int | None, flex: bool) -> Any:
        """The mask of this rank's queries (ring) or all queries (Ulysses) against all keys,
        within `window` when given: FlexAttention BlockMasks (`flex`; ring alltoall: one per
        key shard, in rank order) or a dense (bs, 1, Sq, S) bool mask (None: Ulysses without
        documents or window, causal SDPA)."""
        key = (window, flex)
        if key not in self._masks:
            self._masks[key] = built = self._build(window, flex)
            for mask in built if isinstance(built, list) else [built] if flex else []:
                TILES.add(kind_of(window), mask)
        return self._masks[key]

    def _build(self, window: int | None, flex: bool) -> Any:
        (seg_q, pos_q), (seg_k, pos_k) = self._queries(), self.all
        if flex and self.mode == "ring" and self.rotate == "alltoall":
            world = dist.get_world_size(self.group)
            return [
                document_block_mask(seg_q, pos_q, s, p, window)
                for s, p in zip(seg_k.chunk(world, 1), pos_k.chunk(world, 1), strict=True)
            ]
        if flex:
            return document_block_mask(seg_q, pos_q, seg_k, pos_k, window)
        if self.mode == "ulysses" and self.causal and window is None:
            return None
        mask = allowed(seg_q, pos_q, seg_k, pos_k)
        if window is not None:
            mask = mask & (pos_q[:, None, :, None] - pos_k[:, None, None, :] < window)
        return mask

    @torch.compiler.disable  # collectives inside: the compiled block breaks its graph here
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
        window: int | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """softmax(q kᵀ · scale + mask) v for q, k (bs, H, S/cp, d) and v (bs, H, S/cp, dv) of
        this rank's tokens, within `window` tokens when given, with the sink logits `sinks`
        ((H,) of these heads) in every softmax when given; returns (bs, H, S/cp, dv) in q's
        dtype. The kernel: FlexAttention on CUDA (`device_type`), SDPA or fp32 matmuls else."""
        flex = device_type(q) == "cuda"
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        seq = self.all[0].shape[1]
        # the share of its tiles a balanced rank computes, of all its keys and of each shard's
        fraction = band_fraction(seq, seq, window)
        mask = self.mask(window, flex)
        if self.mode == "ulysses":
            q, k, v = (sequence_to_heads(t, self.group) for t in (q, k, v))
            if sinks is not None:  # this rank's heads
                world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
                sinks = sinks.chunk(world)[rank]
            out = _one_call(q, k, v, mask, scale, sinks, window, flex, fraction)
            return heads_to_sequence(out, self.group)
        if self.rotate == "allgather":
            k, v = gather_sequence(k, 2, self.group), gather_sequence(v, 2, self.group)
            return _one_call(q, k, v, mask, scale, sinks, window, flex, fraction)
        if not flex:
            return ring_attention(q, k, v, mask, scale, self.group, sinks)
        out, lse = flex_ring_attention(q, k, v, mask, scale, self.group, fraction)
        return out if sinks is None else with_sinks(out, lse, sinks)


def _one_call(q, k, v, mask, scale: float, sinks, window, flex: bool, fraction: float):
    """One attention call of q over all of k and v: FlexAttention under a BlockMask (`flex`),
    else SDPA under the dense mask (None: causal), the sinks as its extra key."""
    if flex:
        return flex_attend(q, k, v, mask, scale=scale, sinks=sinks, window=window,
                           fraction=fraction)  # fmt: skip
    if sinks is not None:
        if mask is None:
            mask = band_mask(q.shape[2], k.shape[2], None, q.device)
        return attend_with_sinks(q, k, v, mask, sinks, scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale
    )


def shard_batch(
    inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict, cp: int, rank: int, mode: str,
    balancer: str,
) -> tuple[torch.Tensor, torch.Tensor, dict]:  # fmt: skip
    """This cp rank's share of a (bs, S) batch: its tokens, labels, and the model keywords
    `segments` and `positions` (bs, S/cp), whatever `kwargs` held (none: one causal document
    per row, positions the indices). Ring picks the tokens with `balancer` (auto: work);
    Ulysses takes contiguous shards (each rank attends all tokens for its heads: nothing to
    balance; the config refuses any balancer but none or auto with it)."""
    bs, seq = inputs.shape
    segments, positions = kwargs.get("segments"), kwargs.get("positions")
    if mode == "ulysses" or balancer == "auto":  # `Parallelism.cp_load_balancer`'s reading
        balancer = "none" if mode == "ulysses" else "work"
    order = shard_order(segments, seq, bs, cp, balancer)
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


def needs_own_cp(mode: str, kwargs: dict, local: bool = False) -> bool:
    """Whether a batch goes through this module rather than PyTorch's causal ring: Ulysses
    always, ring when the batch has a document mask (`segments`) or the model has local
    attention (`local`: sliding windows or sinks, `decoder.has_local_attention`)."""
    return mode == "ulysses" or kwargs.get("segments") is not None or local


def own_cp_attention(config, local: bool = False) -> bool:
    """Whether a run (`config` a JobConfig) may train through this module's attention: cp > 1
    with Ulysses, a document mask, packing on (chat SFT data packs with a document mask;
    whether the data are chat is the data layer's to say, so a packed causal run counts too)
    or a model with local attention (`local`). The trainer then compiles its blocks around
    the attention call."""
    data, par = config.data, config.parallelism
    if par.context_parallel_degree <= 1:
        return False
    return par.context_parallel_mode == "ulysses" or data.document_mask or data.packing or local
