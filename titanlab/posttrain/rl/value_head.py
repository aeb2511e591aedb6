"""PPO's value function as a scalar head on the policy's trunk: V(s_t) = w · h_t, with h_t the
final RMSNorm's output at position t (the state that predicts token t + 1), as Hugging Face
TRL's `AutoModelForCausalLMWithValueHead` does (Ziegler et al. 2019; Ouyang et al. 2022).

The head is attached from outside (`value_head`, a (dim,) weight on the model module, before parallelization, so FSDP shards it with the root and tensor parallel replicates
it over the tp ranks), zero-initialized, checkpointed with the model, and read with a forward
hook on the final norm (`read_values`), so the model's forward is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class ValueHead(nn.Module):
    """V = h · w: (..., dim) → (...,). The weight is a (dim,) vector rather than a (1, dim)
    Linear so that FSDP splits it evenly (a one-row weight leaves ranks with empty shards,
    whose gradients FSDP2 does not create)."""

    def __init__(self, dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, device=device))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h * self.weight).sum(dim=-1)


def add_value_head(model: nn.Module) -> None:
    """Attach `model.value_head` (on the model's device, meta included). Raises ValueError
    when the model has no final norm (a pipeline stage)."""
    norm = getattr(model, "norm", None)
    if norm is None:
        raise ValueError("a value head needs the model's final norm (refused under PP)")
    model.value_head = ValueHead(norm.weight.shape[0], device=norm.weight.device)


@torch.no_grad()
def zero_value_head(model_parts: list[nn.Module]) -> None:
    """V = 0 at the start (every return is then an advantage), whatever the layout."""
    for part in model_parts:
        head = getattr(part, "value_head", None)
        if head is not None:
            head.weight.zero_()


@contextlib.contextmanager
def read_values(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within, each forward of `model` appends its values, (B, S) float32 whole tensors (also
    under tensor parallel), to the yielded list."""
    values: list[torch.Tensor] = []

    def hook(module, args, output):
        v = model.value_head(output)
        values.append((v.full_tensor() if isinstance(v, DTensor) else v).float())

    norm: nn.Module = getattr(model, "norm")  # noqa: B009 (nn.Module's __getattr__ types)
    handle = norm.register_forward_hook(hook)
    try:
        yield values
    finally:
        handle.remove()
