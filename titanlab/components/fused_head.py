"""The output head of a model trained with the chunked fused loss (`FusedLossHead`), swapped in
from outside (`use_fused_loss`), and the contexts in which the model's forward returns a loss
instead of logits: the cross-entropy (`fused_targets`), the token log-probabilities of RL
(`fused_logprobs`) and the distillation loss (`teacher_hidden`, `fused_distillation`). The
kernels are in `titanlab.components.fused_ce`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanlab.components.fused_ce import (
    chunked_token_logprobs,
    linear_cross_entropy_sum,
    linear_distillation_loss_sum,
    lora_linear_cross_entropy_sum,
    vocab_parallel_linear_cross_entropy_sum,
)


class FusedLossHead(nn.Linear):
    """The output head of a model trained with the chunked fused loss: a bias-free Linear (its
    `weight` keeps the name, so checkpoints and exports are unchanged) that returns logits as
    usual, or, while `targets(labels)` is active, the summed cross-entropy of its input against
    `labels` computed by `linear_cross_entropy_sum` (0-dim fp32), so the model's forward ends
    in the loss and the logits never exist. Swapped in from outside by `use_fused_loss`,
    before parallelism is applied, so FSDP's hooks on the head (gather, reshard, reduce-scatter)
    run as for the plain Linear."""

    returns_loss = True  # tensor parallel splits it with `FusedHeadParallel`

    def __init__(
        self, in_features: int, out_features: int, chunk_size: int, compiled: bool = False
    ) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.chunk_size = chunk_size
        self.compiled = compiled  # each chunk's softmax and gradient through torch.compile
        self.labels: torch.Tensor | None = None
        self.temperature = 0.0  # > 0: return log-probabilities of `labels` (`fused_logprobs`)
        self.distill: tuple[torch.Tensor, torch.Tensor, float, float] | None = None
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None  # `teacher_hidden`
        self.capture = False
        self.liger = False  # `titanlab.components.liger.apply_liger`: Liger's loss kernel
        # A LoRA adapter kept from the `LoRALinear` head it replaced (`use_fused_loss`): the same
        # modules and names (output.lora_a / output.lora_b), so checkpoints and exports match.
        self.lora_a: nn.Linear | None = None
        self.lora_b: nn.Linear | None = None
        self.scaling = 0.0
        self.dropout: nn.Module = nn.Identity()

    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """As `LoRALinear.reset_adapter` (A Kaiming-uniform, B zeros)."""
        from titanlab.peft.lora import LoRALinear

        LoRALinear.reset_adapter(self, generator)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.capture:  # `teacher_hidden`: the input and the (gathered) weight, no logits
            self.captured = (x, self.weight)
            return x
        lora_a, lora_b = self.lora_a, self.lora_b
        if self.labels is None:
            out = F.linear(x, self.weight)
            if lora_a is not None and lora_b is not None:
                out = out + lora_b(lora_a(self.dropout(x))) * self.scaling
            return out
        if lora_a is not None and lora_b is not None:  # the plain fused loss only: config
            # refuses the other paths with an adapted head
            assert self.distill is None and not self.temperature and not self.liger
            assert not isinstance(self.weight, DTensor), "tensor parallel: refused by config"
            u = lora_a(self.dropout(x)) * self.scaling
            return lora_linear_cross_entropy_sum(
                x, self.weight, u, lora_b.weight, self.labels, self.chunk_size, self.compiled
            )
        if self.distill is not None:  # `fused_distillation`
            assert not isinstance(self.weight, DTensor), "tensor parallel: not yet"
            t_hidden, t_weight, alpha, t = self.distill
            return linear_distillation_loss_sum(
                x, self.weight, t_hidden, t_weight, self.labels, alpha=alpha, temperature=t,
                chunk_size=self.chunk_size,
            )  # fmt: skip
        if self.temperature:  # `fused_logprobs`
            assert not isinstance(self.weight, DTensor), "tensor parallel: not yet"
            return chunked_token_logprobs(
                x, self.weight, self.labels, self.temperature, self.chunk_size
            )
        if isinstance(self.weight, DTensor):  # tensor parallel (`FusedHeadParallel`)
            assert isinstance(x, DTensor)
            return vocab_parallel_linear_cross_entropy_sum(
                x, self.weight, self.labels, self.chunk_size
            )
        if self.liger:
            from titanlab.components.liger import liger_linear_cross_entropy_sum

            return liger_linear_cross_entropy_sum(x, self.weight, self.labels)
        return linear_cross_entropy_sum(x, self.weight, self.labels, self.chunk_size, self.compiled)


def use_fused_loss(model: nn.Module, chunk_size: int, compiled: bool = False) -> None:
    """Swap `model.output` (a bias-free nn.Linear, or a `LoRALinear` whose adapter moves along;
    the model on any device, meta included) for a `FusedLossHead` holding the same
    Parameters; `compiled`: its chunks' softmax and gradient through torch.compile."""
    old = model.output
    assert isinstance(old, nn.Linear) and old.bias is None, "the output head is a bias-free Linear"
    with torch.device("meta"):  # no initialization drawn: the weight is the old head's
        head = FusedLossHead(old.in_features, old.out_features, chunk_size, compiled)
    head.weight = old.weight
    if isinstance(getattr(old, "lora_b", None), nn.Linear):  # peft's LoRALinear
        head.lora_a, head.lora_b = old.lora_a, old.lora_b
        head.scaling, head.dropout = old.scaling, old.dropout
    model.output = head


@contextlib.contextmanager
def fused_targets(model: nn.Module, labels: torch.Tensor) -> Iterator[None]:
    """Within, `model(inputs)` returns the summed token cross-entropy against `labels` ((bs,
    seq) int64, -100 ignored) instead of logits."""
    head = model.output
    assert isinstance(head, FusedLossHead), "use_fused_loss(model) first"
    head.labels = labels
    try:
        yield
    finally:
        head.labels = None


@contextlib.contextmanager
def fused_logprobs(model: nn.Module, targets: torch.Tensor, temperature: float) -> Iterator[None]:
    """Within, `model(inputs)` returns log softmax(logits / temperature)[targets] per position
    ((bs, seq) float32) instead of logits: the RL and preference objectives' forward."""
    head = model.output
    assert isinstance(head, FusedLossHead), "use_fused_loss(model) first"
    head.labels, head.temperature = targets, temperature
    try:
        yield
    finally:
        head.labels, head.temperature = None, 0.0


def teacher_hidden(
    teacher: nn.Module, inputs: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's forward up to its head, for `fused_distillation`: (hidden (bs, seq, D_t),
    head weight (V, D_t)). The weight is the one the head's forward saw: under FSDP the
    all-gathered tensor of the norm + head group, which is never resharded after forward
    (`titanlab.distributed.parallelize`), so it stays valid until the next forward."""
    head = teacher.output
    assert isinstance(head, FusedLossHead), "use_fused_loss(teacher) first"
    head.capture = True
    try:
        teacher(inputs, **kwargs)
        assert head.captured is not None
        hidden, weight = head.captured
    finally:
        head.capture, head.captured = False, None
    return hidden, weight


@contextlib.contextmanager
def fused_distillation(
    model: nn.Module, labels: torch.Tensor, teacher: tuple[torch.Tensor, torch.Tensor],
    alpha: float, temperature: float,
) -> Iterator[None]:  # fmt: skip
    """Within, `model(inputs)` returns the summed distillation loss against `labels` and the
    teacher's (hidden, head weight) from `teacher_hidden` (`linear_distillation_loss_sum`)."""
    head = model.output
    assert isinstance(head, FusedLossHead), "use_fused_loss(model) first"
    head.labels, head.distill = labels, (*teacher, alpha, temperature)
    try:
        yield
    finally:
        head.labels, head.distill = None, None
