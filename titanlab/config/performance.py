"""Sections that trade compute for memory or speed: `[activation_checkpoint]`, `[compile]`,
`[float8]`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlab.config.errors import ConfigError, _require  # noqa: F401


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """none: keep all activations; full: recompute each block in backward; selective: see
    `selective_ac_option`."""

    selective_ac_option: str = "op"
    """For mode=selective: `op` (save matmul and attention outputs, recompute the cheap ops) or an
    integer N (checkpoint every N-th block fully)."""

    def validate(self) -> None:
        opt = self.selective_ac_option
        _require(
            opt == "op" or (opt.isdecimal() and int(opt) >= 1),
            f"activation_checkpoint.selective_ac_option={opt!r} must be 'op' or a positive integer",
        )


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (fullgraph) and the loss."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: any of model (each transformer block) and loss (the cross-entropy; it
    stays eager under tensor parallel's loss parallel)."""

    backend: str = "inductor"
    """torch.compile backend."""

    def validate(self) -> None:
        bad = [c for c in self.components if c not in ("model", "loss")]
        _require(not bad, f"compile.components has {bad}; valid: model, loss")


@dataclass
class Float8:
    enable: bool = False
    """Train the Linear layers in float8 through torchao (needs `pip install 'titanlab[float8]'`
    and an NVIDIA GPU with compute capability >= 8.9, or `emulate`)."""

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao float8 recipe: one dynamic scale per tensor, per row, or per row with the weight
    gradient kept in high precision."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose name contains any of these stay in high precision (Linears with dims
    not divisible by 16 are always skipped)."""

    emulate: bool = False
    """Run the float8 numerics with ordinary matmuls (for CPU tests; no speed-up)."""

    enable_fsdp_float8_all_gather: bool = True
    """With FSDP and the tensorwise recipe, all-gather weights in float8 (half the bytes of bf16)."""

    precompute_float8_dynamic_scale_for_fsdp: bool = True
    """With float8 all-gather: compute all weight scales in one all-reduce after each optimizer step."""

    def validate(self) -> None:
        _require(all(self.filter_fqns), f"float8.filter_fqns={self.filter_fqns} has an empty name")
