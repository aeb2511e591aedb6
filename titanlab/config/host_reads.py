"""Host reads that code leaves out on fake tensors, told to an observer.

A dry run's step and the per-op ledger (`titanlab.ledger`) run on fake tensors, which hold no
values, so code that reads a device tensor on the host (expert parallel's split sizes) takes
another branch there (even splits). A GPU run still makes that read, a host sync: the CPU
waits for the GPU's queue to drain before it can launch the next kernel. `skipped` tells the
innermost observer (the ledger's recorder counts it as one) what a GPU run would read.

A call costs one list check when nothing observes.
"""

from __future__ import annotations

from typing import Protocol

import torch


class HostReadObserver(Protocol):
    """Told of each host read the code skipped on fake tensors: the tensor the GPU run reads
    and a name for the read."""

    def host_read(self, what: str, tensor: torch.Tensor) -> None: ...


OBSERVERS: list[HostReadObserver] = []
"""The observers now listening, innermost last (only the last is told)."""


def skipped(what: str, tensor: torch.Tensor) -> None:
    """Tell the innermost observer that a GPU run reads `tensor` on the host here (`what`
    names the read, e.g. "expert_parallel.splits"); the caller used a stand-in value."""
    if OBSERVERS:
        OBSERVERS[-1].host_read(what, tensor)
