"""Per-token log-probabilities of given tokens under a (possibly parallelized) policy: the one
forward every RL and preference objective shares."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanlab.posttrain.rl.objectives import token_logprobs


def sequence_logprobs(
    model: nn.Module, sequences: torch.Tensor, temperature: float = 1.0, tp_degree: int = 1
) -> torch.Tensor:
    """log π(sequences[:, t + 1] | sequences[:, : t + 1]) at `temperature` for every t.

    Args:
        sequences: (B, S) int64; rows may be right-padded (causal attention keeps padding out
            of every earlier position; mask the padded targets yourself).
        tp_degree: under tensor parallel the sequence is padded to a multiple of it (sequence
            parallel splits it) and the logits are gathered whole.
    Returns:
        (B, S − 1) float32.
    """
    inputs, targets = sequences[:, :-1], sequences[:, 1:]
    length = inputs.shape[1]
    pad = -length % tp_degree
    logits = model(F.pad(inputs, (0, pad), value=0) if pad else inputs)[:, :length]
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return token_logprobs(logits, targets, temperature)
