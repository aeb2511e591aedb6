"""The `[peft]` section: parameter-efficient fine-tuning (LoRA)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlab.config.errors import _require


@dataclass
class Peft:
    method: Literal["none", "lora"] = "none"
    """none: train every weight. lora: freeze the model and train low-rank adapters on the
    `target_modules` (Hu et al. 2021, "LoRA"); checkpoints then hold only the adapters (and
    their optimizer state), the base comes from `checkpoint.initial_load_path`."""

    rank: int = 8
    """LoRA rank r: each adapted Linear W (out × in) gains B (out × r) · A (r × in)."""

    alpha: float = 16.0
    """LoRA alpha: the adapter's output is scaled by alpha / rank."""

    dropout: float = 0.0
    """Dropout on the adapter's input (training only). The mask is keyed by each element's
    position in the whole input, so tensor-parallel ranks drop what one process drops; a block
    with dropout under activation checkpointing recomputes the same mask."""

    target_modules: list[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo"])
    """Names of the Linear layers to adapt, matched against the last part of each module's name
    (wq, wk, wv, wo, w1, w2, w3, output; on the command line `wq,wo` or `["wq", "wo"]`). An MoE
    model's router (gate) is refused, and so is the output head of a model that ties it to the
    embedding."""

    quantize_base: Literal["none", "nf4"] = "none"
    """nf4: QLoRA (Dettmers et al. 2023): the adapted Linear weights of the base are stored in
    4-bit NormalFloat (torchao's NF4, blocks of 64 with double-quantized scales, about 0.26 of
    bf16's bytes), sharded by FSDP or split by tensor parallel (each TP rank keeps NF4 shards
    with the whole weight's values; TP and FSDP together are refused), and dequantized per block
    in forward; the adapters stay in the compute dtype. Needs `method = "lora"` and
    `checkpoint.initial_load_path` (the base to quantize)."""

    def validate(self) -> None:
        _require(self.rank >= 1, f"peft.rank={self.rank} must be >= 1")
        _require(self.alpha > 0, f"peft.alpha={self.alpha} must be > 0")
        _require(0 <= self.dropout < 1, f"peft.dropout={self.dropout} must be in [0, 1)")
        _require(
            self.method == "none" or bool(self.target_modules),
            "peft.target_modules is empty; name the Linear layers to adapt, e.g. wq,wv",
        )
        _require(
            self.quantize_base == "none" or self.method == "lora",
            f"peft.quantize_base={self.quantize_base} needs peft.method=lora (QLoRA trains "
            "adapters over the quantized base)",
        )
