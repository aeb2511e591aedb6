"""Which device's code path runs: the tensors' own device, or, while the ledger prices a step
for a GPU it does not have (`titanlab.ledger`), that GPU's.

Code that branches on the device (a kernel choice, an accumulation dtype, a fused optimizer)
asks `device_type(x)` and, where it matters, `device_capability(x)` instead of reading
`x.device.type`: in a real run they answer for `x` itself; inside `code_path_of(...)` they
answer for the target, so the ledger's fake CPU tensors take the branches the GPU would.
`tests/unit/config/test_device_path.py` lists every device branch in titanlab and fails on a new
one that does not go through here (or is not listed with the reason it cannot).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    """A device whose code path is taken: its type ("cuda") and compute capability."""

    type: str
    capability: tuple[int, int] = (0, 0)


_TARGET: list[Target] = []  # a stack; the ledger is single-threaded


@contextlib.contextmanager
def code_path_of(target: Target) -> Iterator[None]:
    """Inside, `device_type` and `device_capability` answer for `target`."""
    _TARGET.append(target)
    try:
        yield
    finally:
        _TARGET.pop()


def target() -> Target | None:
    """The target whose code path runs (inside `code_path_of`), or None."""
    return _TARGET[-1] if _TARGET else None


def _type_of(where: torch.Tensor | torch.device | str) -> str:
    if isinstance(where, torch.Tensor):
        return where.device.type
    return torch.device(where).type if isinstance(where, str) else where.type


def device_type(where: torch.Tensor | torch.device | str) -> str:
    """The device type ("cuda", "cpu", ...) whose code path to take for `where` (a tensor, a
    device or its name): the target's inside `code_path_of`, else `where`'s own."""
    return _TARGET[-1].type if _TARGET else _type_of(where)


def device_capability(where: torch.Tensor | torch.device) -> tuple[int, int]:
    """The CUDA compute capability whose code path to take for `where`: the target's inside
    `code_path_of`, else the device's own ((0, 0) for a device that is not a CUDA GPU)."""
    if _TARGET:
        return _TARGET[-1].capability
    device = where.device if isinstance(where, torch.Tensor) else where
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)
