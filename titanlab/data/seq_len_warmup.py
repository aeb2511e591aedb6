"""Sequence-length warmup (`training.seq_len_warmup_steps`): short sequences first, doubling
up to `training.seq_len` (Li et al. 2022, "The Stability-Efficiency Dilemma: Investigating
Sequence Length Warmup for Training GPT Models", whose schedule grows the length over the
first steps; here in powers of two so every length divides the window).

The loader always delivers windows of `seq_len`; during the warmup each window is cut into
2^k consecutive rows of `seq_len / 2^k` tokens. The tokens per step, the data order and the
loader's state are those of a run without warmup, so a resume is exact at any step.
"""

from __future__ import annotations

import torch


def warmup_seq_len(step: int, seq_len: int, start: int, warmup_steps: int) -> int:
    """The sequence length of training step `step` (1-based).

    With K = log2(seq_len / start), the warmup's steps are split into K + 1 equal stages of
    lengths start, 2·start, ..., seq_len; after `warmup_steps`, seq_len. `warmup_steps` 0: off.
    """
    if warmup_steps <= 0 or step > warmup_steps:
        return seq_len
    doublings = (seq_len // start).bit_length() - 1
    stage = min(doublings, (step - 1) * (doublings + 1) // warmup_steps)
    return start << stage


def split_windows(
    inputs: torch.Tensor, labels: torch.Tensor, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bs, L) inputs and labels as (bs · L/seq, seq): each window cut into consecutive rows
    (views, no copy). `seq` must divide L."""
    return inputs.reshape(-1, seq), labels.reshape(-1, seq)
