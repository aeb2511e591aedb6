"""The `[optimizer]` section: AdamW, or Muon for the blocks' matrices with AdamW for the rest
(`titanlab.components.optim`, `titanlab.components.muon`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titanlab.config.errors import _require, spelled


@dataclass
class Optimizer:
    name: Literal["AdamW", "Muon"] = "AdamW"
    """Optimizer. AdamW with decoupled weight decay (Loshchilov & Hutter, 2019), or Muon
    (Jordan et al. 2024, as Moonlight scales it: arXiv:2502.16982) for the blocks' matrices and
    expert stacks with AdamW for the rest (embeddings, head, norms, router, MTP depths). Pick
    Muon to pretrain: on `make train`'s job it reached AdamW's final validation loss in 0.60×
    the tokens and 0.53× the seconds, its step 1.01-1.10× AdamW's on 2 ranks (docs/performance.md); not
    with LoRA, float8 or RL (refused)."""

    lr: float = 8e-4
    """Peak learning rate, reached at the end of warmup."""

    beta1: float = 0.9
    """AdamW β1."""

    beta2: float = 0.95
    """AdamW β2."""

    eps: float = 1e-8
    """AdamW ε."""

    weight_decay: float = 0.1
    """Decoupled weight decay."""

    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """Kernel choice for the update; `fused` falls back to `foreach` where the device lacks it."""

    muon_lr: float = -1.0
    """Muon's peak learning rate (its update scaled by 0.2·√max(rows, cols) to AdamW's RMS, so
    AdamW's lr carries over); -1: `optimizer.lr`."""

    muon_weight_decay: float = -1.0
    """Muon's decoupled weight decay; -1: `optimizer.weight_decay`."""

    muon_momentum: float = 0.95
    """Muon's momentum μ, in [0, 1)."""

    muon_nesterov: bool = True
    """Nesterov momentum for Muon's update."""

    muon_ns_steps: int = 5
    """Newton–Schulz iterations orthogonalizing each update (torch.optim.Muon's 5)."""

    muon_ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Precision of the Newton–Schulz iteration: bfloat16 as torch.optim.Muon and Moonlight
    compute it (fast on GPUs), or float32, which layouts reproduce within 1e-5 of each other
    (bfloat16 turns the last-bit differences of another reduction order into ~1e-3 ones)."""

    qk_clip_threshold: float = -1.0
    """MuonClip's QK-clip τ (Kimi K2, arXiv:2507.20534): after each step, the query and key
    weights of a head whose largest pre-softmax logit of the step exceeded τ are rescaled so
    that it falls back to τ (`titanlab.distributed.qk_clip`; Kimi K2 used 100). -1: off. Costs
    one more q·kᵀ per attention (the logits are not kept by SDPA)."""

    def validate(self) -> None:
        _require(
            self.qk_clip_threshold == -1 or self.qk_clip_threshold > 0,
            f"optimizer.qk_clip_threshold={self.qk_clip_threshold} must be > 0 (or -1: off)",
        )
        _require(
            0 <= self.muon_momentum < 1,
            f"optimizer.muon_momentum={self.muon_momentum} must be in [0, 1)",
        )
        _require(
            1 <= self.muon_ns_steps < 100,
            f"optimizer.muon_ns_steps={self.muon_ns_steps} must be in 1..99",
        )
        _require(
            self.muon_lr == -1 or self.muon_lr > 0,
            f"optimizer.muon_lr={self.muon_lr} must be > 0 (or -1: optimizer.lr)",
        )
        _require(
            self.muon_weight_decay == -1 or self.muon_weight_decay >= 0,
            f"optimizer.muon_weight_decay={self.muon_weight_decay} must be >= 0 (or -1: "
            "optimizer.weight_decay)",
        )
        if self.name != "Muon":  # options of Muon's groups, which AdamW alone has none of
            defaults = Optimizer()
            for key in ("muon_lr", "muon_weight_decay", "muon_momentum", "muon_nesterov",
                        "muon_ns_steps", "muon_ns_dtype"):  # fmt: skip
                value = getattr(self, key)
                _require(
                    value == getattr(defaults, key),
                    f"optimizer.{key}={spelled(value)} sets Muon's parameter groups, and "
                    f"optimizer.name={self.name} has none; set optimizer.name=Muon or drop it",
                )
        _require(self.lr > 0, f"optimizer.lr={self.lr} must be > 0")
        _require(0 <= self.beta1 < 1, f"optimizer.beta1={self.beta1} must be in [0, 1)")
        _require(0 <= self.beta2 < 1, f"optimizer.beta2={self.beta2} must be in [0, 1)")
        _require(self.eps > 0, f"optimizer.eps={self.eps} must be > 0")
        _require(self.weight_decay >= 0, f"optimizer.weight_decay={self.weight_decay} must be >= 0")
