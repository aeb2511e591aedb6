"""The plain PyTorch training loop `tools/benchmark.py` measures the trainer against: titanlab's
model, then plain PyTorch only (torch.autocast to bf16, `F.cross_entropy` on fp32 logits,
`clip_grad_norm_`, fused AdamW, the blocks and the loss compiled when asked). Built by `build`,
stepped by its `step`; the benchmark times it on a device and the per-op ledger
(`tests/unit/ledger/test_trainer_overhead.py`) records it on fake tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class PlainLoop:
    """A built loop: the model, its optimizer, the loss, its training FLOPs per token."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    flops_per_token: float
    amp: bool
    device: torch.device

    def step(self, xy: torch.Tensor) -> torch.Tensor:
        """One training step on `xy` ((bs, seq + 1) int64 token ids); returns the loss (0-dim,
        not synchronized)."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            logits = self.model(xy[:, :-1])  # (bs, seq, vocab)
        loss = self.loss_fn(logits, xy[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def build(spec: dict[str, Any], device: torch.device, init_weights: bool = True) -> PlainLoop:
    """The loop of `spec` (model family, flavor, layers or None for the flavor's, vocab, seq,
    precision "fp32" | "bf16" | "float8", compile) on `device`, its weights initialized unless
    `init_weights` is False (fake tensors: their initializers read values)."""
    from titanlab.components.compiled import compile_function
    from titanlab.models.common.counting import count_active_params
    from titanlab.models.registry import get_family

    family = get_family(spec["model"])
    base = family.flavors[spec["flavor"]]
    args = dataclasses.replace(
        base,
        vocab_size=spec["vocab"],
        max_seq_len=spec["seq"],
        n_layers=spec["layers"] or base.n_layers,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = family.model_cls(args)
    if init_weights:
        model.init_weights()
    active = count_active_params(model, exclude_embedding=True)  # MoE: top_k of the experts
    flops = family.flops_per_token(args, spec["seq"], active)
    if spec["precision"] == "float8":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "output")
    loss_fn = cross_entropy
    if spec["compile"]:
        for block in model.layers.values():
            block.compile(fullgraph=True)
        loss_fn = compile_function(cross_entropy)
    opt = torch.optim.AdamW(
        model.parameters(), lr=4e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    return PlainLoop(model, opt, loss_fn, flops, spec["precision"] != "fp32", device)


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (bs, seq, vocab) logits, in fp32, against (bs, seq) ids."""
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
