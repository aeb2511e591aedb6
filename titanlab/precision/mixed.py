"""Mixed precision outside FSDP: autocast, and dynamic loss scaling for float16.

Under FSDP2 (`fully_shard`, and its `replicate` for DDP), `MixedPrecisionPolicy` casts parameters to the compute dtype (see parallelize.py).
Without it (one device, pure TP/PP) the forward runs under `torch.autocast` instead, with
fp32 master weights either way. float16 has a narrow exponent range, so its gradients are
computed on a loss multiplied by a dynamic scale that halves whenever a gradient overflows
(that step is skipped) and doubles after `growth_interval` clean steps (Micikevicius et al.
2018, "Mixed Precision Training"; `torch.amp.GradScaler`, `ShardedGradScaler` under FSDP).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def autocast_context(device: torch.device, compute_dtype: torch.dtype, fsdp2_managed: bool):
    """`torch.autocast` to `compute_dtype` when FSDP2 does not already cast, else a no-op."""
    if fsdp2_managed or compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype)


def build_grad_scaler(
    device: torch.device, compute_dtype: torch.dtype, fsdp2_managed: bool, init_scale: float
):
    """A gradient scaler for float16 compute (DTensor-aware under FSDP2), else None."""
    if compute_dtype != torch.float16:
        return None
    if fsdp2_managed:
        return ShardedGradScaler(device.type, init_scale=init_scale)
    return torch.amp.GradScaler(device.type, init_scale=init_scale)
