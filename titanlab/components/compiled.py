"""`torch.compile` for a function (the loss, the fused loss's chunk), with a hook that lets an
observer see each call as one compiled region: the per-op ledger (`titanlab.ledger.record`)
prices the pointwise ops a compiled function runs as Inductor's fused kernels, as it does
for compiled modules.

A call costs one list check when nothing observes; torch.compile's own behaviour is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch


class RegionObserver(Protocol):
    """Told of each call of a compiled function: `enter` before it (with the function's name and
    its arguments), `leave` after it (with what `enter` returned and the call's outputs)."""

    def enter(self, name: str, args: tuple, kwargs: dict) -> Any: ...

    def leave(self, token: Any, outputs: Any) -> None: ...


OBSERVERS: list[RegionObserver] = []
"""The observers now listening, innermost last (only the last is told)."""


def compile_function(fn: Callable) -> Callable:
    """`torch.compile(fn)`, whose calls the innermost of `OBSERVERS` sees as compiled regions."""
    compiled = torch.compile(fn)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not OBSERVERS:
            return compiled(*args, **kwargs)
        observer = OBSERVERS[-1]
        token = observer.enter(fn.__name__, args, kwargs)
        outputs = None
        try:
            outputs = compiled(*args, **kwargs)
            return outputs
        finally:
            observer.leave(token, outputs)

    return run
