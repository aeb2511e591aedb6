"""Activation offloading: the tensors each transformer block saves for backward go to host memory
as they are saved and come back when backward needs them, so device memory holds one block's
activations at a time instead of all of them (torchtune's `OffloadActivations` does the same
through PyTorch's `torch.autograd.graph.saved_tensors_hooks`).

On CUDA each saved tensor is copied into pinned host memory on a side stream (the copy overlaps
the next ops; the tensor is kept alive for that stream until the copy ends), and copied back
before use in backward. Parameters and small tensors (under `min_bytes`) stay where they are.
It composes with activation checkpointing: a checkpointed block saves only its input, which is
then what moves. On CPU activations already live in host memory: the pre-flight refuses the
option there (`check_offload`), and `apply_offload` called on CPU does nothing and says so.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from titanlab.config.errors import ConfigError

logger = logging.getLogger("titanlab")


class OffloadSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Within, every tensor autograd saves on `device_type` (at least `min_bytes`, not a
    Parameter) is kept as a host copy until backward unpacks it. `device_type` "cpu" copies
    host to host: the same bookkeeping without a device, for tests."""

    def __init__(self, device_type: str = "cuda", min_bytes: int = 1 << 16) -> None:
        self.device_type, self.min_bytes = device_type, min_bytes
        self.stream = torch.cuda.Stream() if device_type == "cuda" else None
        self.offloaded = 0  # tensors moved so far (a counter for tests and logs)
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if (
            t.device.type != self.device_type
            or isinstance(t, nn.Parameter)
            or t.numel() * t.element_size() < self.min_bytes
        ):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.stream is not None)
        self.offloaded += 1
        if self.stream is None:
            host.copy_(t)
            return (t.device, host, None)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        t.record_stream(self.stream)  # not reused before the copy ends
        return (t.device, host, done)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, done = packed
        if done is not None:
            done.synchronize()
        return host.to(device, non_blocking=True)


def check_offload(enabled: bool, device: torch.device) -> None:
    """Before launch: offloading asked for on a device without it (CPU, where activations
    already live in host memory) is refused.

    Raises:
        ConfigError: one line naming the option and the device.
    """
    if enabled and device.type != "cuda":
        raise ConfigError(
            f"activation_checkpoint.offload=true needs a CUDA GPU; on {device.type} the "
            "activations already live in host memory; set activation_checkpoint.offload=false"
        )


def apply_offload(blocks: list[nn.Module], device: torch.device) -> OffloadSavedTensors | None:
    """Offload what each of `blocks` saves for backward (their forwards run inside the hooks).
    Returns the hooks (None on a device without offloading: CPU, where it would be a copy of
    host memory to host memory; logged once)."""
    if device.type != "cuda":
        logger.info("activation offloading: a no-op on %s (activations are in host memory)",
                    device.type)  # fmt: skip
        return None
    hooks = OffloadSavedTensors("cuda")
    wrap_blocks(blocks, hooks)
    return hooks


def wrap_blocks(blocks: list[nn.Module], hooks: OffloadSavedTensors) -> None:
    """Enter `hooks` before each block's forward and leave it after."""
    for block in blocks:
        block.register_forward_pre_hook(lambda *_: hooks.__enter__())
        block.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
