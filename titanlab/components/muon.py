"""Muon for the blocks' matrices, AdamW for everything else: `optimizer.name = "Muon"`.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) as "Muon is Scalable for
LLM Training" (Liu et al. 2025, arXiv:2502.16982, the Moonlight models) defines it: Nesterov
momentum, the quintic Newton–Schulz iteration orthogonalizing each weight matrix's update
(torch.optim.Muon's coefficients and 5 steps: `torch.optim._muon._zeropower_via_newtonschulz`,
reused here), the update scaled by 0.2·√max(rows, cols) so that its RMS matches AdamW's and
AdamW's learning rate and weight decay carry over (torch's `adjust_lr_fn="match_rms_adamw"`),
and decoupled weight decay. One optimizer holds both kinds of parameter group, so that a model
part has one optimizer whose state DCP saves and reshards by parameter name.

- **Muon** takes the 2-D weights of the transformer blocks (`layers.*`) and the 3-D expert
  stacks (E, rows, cols), one matrix per expert; not the MoE router.
- **AdamW** takes the rest: embeddings, the output head, norms, biases, the router and the
  multi-token prediction depths (`mtp.*`), with `optimizer.lr`, `beta1`, `beta2`, `eps` and
  `weight_decay`; Muon's groups take `optimizer.muon_lr` / `muon_weight_decay` (default: the
  same values).

Under FSDP, HSDP, ZeRO 1–2, tensor parallel (1D), expert parallel and pipeline parallel a
parameter is a DTensor: each whole update is assembled on one owner rank, owners balanced by
Newton–Schulz FLOPs, orthogonalized there and its shards returned
(`titanlab.components.muon_sharded`), so every layout computes what one process computes while
each rank does about 1/n of the orthogonalization.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.adam import adam

from titanlab.components.muon_sharded import buckets, ns_flops, orthogonalize_bucket
from titanlab.config.job_config import ConfigError, JobConfig, Optimizer

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
"""The quintic iteration's (a, b, c): torch.optim.Muon's (Jordan et al. 2024)."""


def takes_muon(name: str, param: Tensor) -> bool:
    """Whether Muon updates the parameter `name` (a model part's FQN): a block's matrix or
    expert stack, not its router."""
    return name.startswith("layers.") and param.ndim >= 2 and ".router." not in name


def check_muon(config: JobConfig) -> None:
    """What Muon does not take yet, refused before launch with one line (ConfigError)."""
    if config.optimizer.name != "Muon":
        return
    refused = {
        "peft.method=lora (the adapters' A and B)": config.peft.method == "lora",
        "float8.enable=true (float8 Linear weights)": config.float8.enable,
        "rl.algorithm": config.rl.algorithm != "none",
    }
    for what, on in refused.items():
        if on:
            raise ConfigError(
                f"optimizer.name=Muon with {what} is not supported yet; use optimizer.name=AdamW"
            )


def param_groups(model: nn.Module, cfg: Optimizer) -> list[dict[str, Any]]:
    """The Muon group and the AdamW group of `model`'s trained parameters (empty ones left
    out)."""
    muon: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if takes_muon(name, p) else rest).append(p)
    lr = cfg.muon_lr if cfg.muon_lr > 0 else cfg.lr
    wd = cfg.muon_weight_decay if cfg.muon_weight_decay >= 0 else cfg.weight_decay
    groups = [
        {"params": muon, "muon": True, "lr": lr, "weight_decay": wd},
        {"params": rest, "muon": False},
    ]
    return [g for g in groups if g["params"]]


def newton_schulz_fp32(g: Tensor, ns_steps: int) -> Tensor:
    """The quintic Newton–Schulz iteration of `torch.optim._muon._zeropower_via_newtonschulz`
    (Jordan et al. 2024: X ← aX + (bA + cA²)X with A = XXᵀ, after scaling X to unit Frobenius
    norm, on the wide orientation), in float32 instead of bfloat16: deterministic up to float32
    rounding, so that layouts whose gradient sums round differently still agree within 1e-5
    (bfloat16's 8-bit mantissa turns a 1e-7 difference of the input into a 4e-3 one)."""
    a, b, c = NS_COEFFICIENTS
    tall = g.size(0) > g.size(1)
    x = (g.T if tall else g).float()
    x = x / x.norm().clamp(min=EPS)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def orthogonalized(update: Tensor, ns_steps: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Newton–Schulz orthogonalization of a whole matrix (rows, cols) or of each matrix of a
    stack (E, rows, cols): in bfloat16 as torch.optim.Muon computes it (its own function), or
    in float32 (`newton_schulz_fp32`)."""
    if update.ndim == 2:
        if dtype == torch.float32:
            return newton_schulz_fp32(update, ns_steps)
        return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, ns_steps, EPS)
    return torch.stack([orthogonalized(m, ns_steps, dtype) for m in update])


def orthogonalize_all(
    updates: list[Tensor], ns_steps: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[list[Tensor], int, float]:
    """Each update orthogonalized (`orthogonalized`), and the Newton–Schulz FLOPs and host
    seconds this rank spent (the compute alone: on CPU its time, on CUDA its launches). A
    DTensor whose matrices are sharded is assembled on its owner rank and its shards returned
    (`titanlab.components.muon_sharded`); one whose matrices are whole on this rank (replicated,
    or an expert stack split by expert) and a plain tensor are orthogonalized in place."""
    out: list[Tensor | None] = [None] * len(updates)
    flops, seconds = 0, 0.0

    def piece(t: Tensor) -> Tensor:
        nonlocal flops, seconds
        flops += ns_flops(tuple(t.shape), ns_steps)
        start = time.perf_counter()
        result = orthogonalized(t, ns_steps, dtype)
        seconds += time.perf_counter() - start
        return result

    sharded, whole = buckets(updates, ns_steps)
    for pos in whole:
        u = updates[pos]
        if isinstance(u, DTensor):
            local = piece(u.to_local()).to(u.dtype)
            out[pos] = DTensor.from_local(local, u.device_mesh, u.placements, run_check=False,
                                          shape=u.shape, stride=u.stride())  # fmt: skip
        else:
            out[pos] = piece(u)
    for bucket in sharded:
        for pos, t in orthogonalize_bucket(bucket, updates, piece).items():
            out[pos] = t
    return [t for t in out if t is not None], flops, seconds


class MuonAdamW(torch.optim.AdamW):
    """AdamW whose groups marked `muon` are updated by Muon instead (module docstring).

    A Muon group's state per parameter is its momentum buffer ("momentum_buffer", shaped like
    the parameter: one buffer where AdamW keeps two) and its step count ("step", a 0-dim
    float32 tensor as AdamW's, which its state loading requires); an AdamW group's is AdamW's.
    `ns_flops` and `ns_seconds` are the Newton–Schulz FLOPs and host seconds this rank spent in
    the last step.
    """

    def __init__(self, groups: list[dict[str, Any]], cfg: Optimizer, **adamw: Any) -> None:
        super().__init__(
            groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            **adamw,
        )
        for group in self.param_groups:
            group.setdefault("momentum", cfg.muon_momentum)
            group.setdefault("nesterov", cfg.muon_nesterov)
            group.setdefault("ns_steps", cfg.muon_ns_steps)
            group.setdefault("ns_dtype", cfg.muon_ns_dtype)
        self.ns_flops, self.ns_seconds = 0, 0.0

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One update of every group: Muon's (`_muon_step`), then AdamW's exactly as
        `torch.optim.AdamW.step` does it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.ns_flops, self.ns_seconds = 0, 0.0
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        """torch.optim.Muon's update (`_single_tensor_muon`) on whole matrices: momentum
        (Nesterov), orthogonalized, lr × 0.2·√max(rows, cols), decoupled weight decay."""
        lr, wd, m = group["lr"], group["weight_decay"], group["momentum"]
        params: list[Tensor] = []
        updates: list[Tensor] = []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
                state["step"] = torch.zeros((), dtype=torch.float32)
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - m)
            params.append(p)
            updates.append(p.grad.lerp(buf, m) if group["nesterov"] else buf)
        dtype = getattr(torch, group["ns_dtype"])
        updates, flops, seconds = orthogonalize_all(updates, group["ns_steps"], dtype)
        self.ns_flops += flops
        self.ns_seconds += seconds
        for p, update in zip(params, updates, strict=True):
            adjusted = _adjust_lr(lr, "match_rms_adamw", p.shape[-2:])
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-adjusted)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        max_exp_avg_sqs: list[Tensor] = []
        steps: list[Tensor] = []
        has_complex = self._init_group(
            group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
        )
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            amsgrad=group["amsgrad"],
            has_complex=has_complex,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )


TIMES_ENV = "TITANLAB_MUON_TIMES"
"""Set to a path prefix and the trainer appends each step's optimizer and Newton–Schulz host
seconds of each rank to `<prefix>.rank<r>.jsonl` (`tools/benchmark.py --matrix muon` reads
them to compare the ranks' work)."""


def record_times(rank: int, step: int, optimizers: list, optimizer_s: float) -> None:
    """Append this rank's `{"step", "optimizer_s", "ns_s", "ns_gflop"}` to the file `TIMES_ENV`
    names (nothing when it is unset)."""
    import json
    import os

    prefix = os.environ.get(TIMES_ENV)
    if not prefix:
        return
    record = {
        "step": step,
        "optimizer_s": optimizer_s,
        "ns_s": sum(getattr(o, "ns_seconds", 0.0) for o in optimizers),
        "ns_gflop": sum(getattr(o, "ns_flops", 0) for o in optimizers) / 1e9,
    }
    with open(f"{prefix}.rank{rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
