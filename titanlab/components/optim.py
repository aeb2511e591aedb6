"""AdamW (or Muon with AdamW) and the learning-rate schedule (warmup, then optional stable
phase, then decay)."""

from __future__ import annotations

import functools
import math
from typing import cast

import torch
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from titanlab.config.job_config import LRScheduler, Optimizer
from titanlab.config.device_path import device_type


def build_optimizer(
    model: torch.nn.Module, cfg: Optimizer, device: torch.device, allow_fused: bool = True
) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019) over `model`'s trained parameters with the
    implementation asked for, or with `cfg.name` "Muon" Muon for the blocks' matrices and that
    AdamW for the rest (`titanlab.components.muon`).

    `fused` uses the fused kernel (CUDA and CPU in recent PyTorch) unless `allow_fused` is False
    (torch 2.13's fused AdamW mis-broadcasts GradScaler's overflow flag, so float16 training
    uses `foreach`); `foreach` the multi-tensor path; `for-loop` the reference loop.
    """
    from titanlab.components.muon import MuonAdamW, param_groups

    impl = cfg.implementation
    fused: bool | None = None  # None: AdamW's own default
    foreach: bool | None = None
    fused_ok = allow_fused and device_type(device) in _get_fused_kernels_supported_devices()
    if impl == "fused" and fused_ok:
        fused = True
    elif impl in ("foreach", "fused"):
        foreach = True
    else:
        foreach = False
    if cfg.name == "Muon":
        return MuonAdamW(param_groups(model, cfg), cfg, foreach=foreach, fused=fused)
    return torch.optim.AdamW(
        [q for q in model.parameters() if q.requires_grad],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=foreach,
        fused=fused,
    )


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_ratio: float,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based count of steps taken).

    Linear warmup over `warmup_steps` (starting at 1/(warmup+1) so the first step moves), then a
    constant phase, then decay over the last `decay_ratio` of the remaining steps (-1: all of
    them) to `min_lr_factor`. decay_type: linear; cosine (Loshchilov & Hutter 2017, SGDR); sqrt
    (1 - sqrt(progress), as used for WSD schedules, Hägele et al. 2024).
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    after = max(total_steps - warmup_steps, 1)
    decay_steps = after if decay_ratio < 0 else max(round(after * decay_ratio), 0)
    decay_start = total_steps - decay_steps
    if step < decay_start or decay_steps == 0:
        return 1.0
    # The first decay step still uses the peak and the last step (total-1) the minimum.
    progress = min((step - decay_start) / max(decay_steps - 1, 1), 1.0)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(f"lr_scheduler.decay_type={decay_type!r}; valid: linear, cosine, sqrt")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `lr_factor`; its state_dict (the step count) goes into checkpoints."""
    fn = functools.partial(
        lr_factor,
        warmup_steps=cfg.warmup_steps,
        total_steps=total_steps,
        decay_ratio=cfg.decay_ratio,
        decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


class OptimizersContainer:
    """One optimizer per model part (pipeline stage), driven as one optimizer.

    Per-part optimizers keep each stage's optimizer state addressable by that stage's parameter
    names, which is what lets DCP save and reshard it (`get_optimizer_state_dict(part, opt)`).
    """

    def __init__(
        self,
        model_parts: list[torch.nn.Module],
        cfg: Optimizer,
        device: torch.device,
        allow_fused: bool = True,
    ):
        self.model_parts = model_parts
        self.optimizers = [build_optimizer(p, cfg, device, allow_fused) for p in model_parts]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)


class LRSchedulersContainer:
    """One LambdaLR per optimizer of an `OptimizersContainer`, all on the same schedule."""

    def __init__(self, optimizers: OptimizersContainer, cfg: LRScheduler, total_steps: int):
        self.schedulers = [build_lr_scheduler(o, cfg, total_steps) for o in optimizers.optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        # Plain floats: the peak lr is a float in the config (LambdaLR types it float | Tensor).
        return cast("list[float]", self.schedulers[0].get_last_lr())

    def state_dict(self) -> dict:
        """The schedule position (identical for every part)."""
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        for s in self.schedulers:
            s.load_state_dict(dict(state_dict))
