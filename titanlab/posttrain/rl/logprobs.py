"""Per-token log-probabilities of given tokens under a (possibly parallelized) policy: the one
forward every RL and preference objective shares."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titanlab.components.fused_head import FusedLossHead, fused_logprobs
from titanlab.distributed.utils import global_max
from titanlab.models.common.decoder import moe_layers
from titanlab.posttrain.rl.objectives import token_logprobs

WIDTH_MULTIPLE = 8


def batch_width(local: int, model: nn.Module, dp_mesh: DeviceMesh | None,
                device: torch.device) -> int:  # fmt: skip
    """The width (tokens per row) a data-parallel rank pads its batch to, `local` being its
    longest row. A dense model: `local` (causal attention keeps right padding out of every
    real position). A model with MoE layers: the longest row over the ranks, raised so the
    inputs (width − 1) are a multiple of 8, so every layout forwards the same rows, padding
    included: an MoE layer's load-balance statistics count every token of the global batch,
    and a tensor-parallel degree dividing 8 splits the sequence without adding any token.
    (One all-reduce of an integer.)"""
    if not moe_layers(model):
        return local
    width = int(global_max(torch.tensor(local, device=device), dp_mesh))
    return width + (-(width - 1) % WIDTH_MULTIPLE)


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
        (B, S − 1) float32. With the fused loss's head (`loss.fused_linear_cross_entropy`)
        the log-probabilities come chunk by chunk from the head (no logits tensor).
    """
    inputs, targets = sequences[:, :-1], sequences[:, 1:]
    inner = getattr(model, "policy", model)  # the LoRA reference wraps the policy
    if isinstance(getattr(inner, "output", None), FusedLossHead):  # `loss.fused_...`: no logits
        with fused_logprobs(inner, targets, temperature):
            return model(inputs)
    length = inputs.shape[1]
    pad = -length % tp_degree
    logits = model(F.pad(inputs, (0, pad), value=0) if pad else inputs)[:, :length]
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return token_logprobs(logits, targets, temperature)
