"""Peak dense FLOP/s of an accelerator, for MFU.

MFU = achieved model FLOP/s ÷ peak dense FLOP/s of the device (Chowdhery et al. 2022, PaLM,
Appendix B). The table holds the vendors' data-sheet figures for dense bf16 tensor-core math,
without sparsity.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("GH200", 989e12),
    ("B200", 2.25e15),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def device_peak_flops(device: torch.device, configured: float = 0.0) -> float | None:
    """Peak dense FLOP/s of one device: `configured` when > 0, else the table entry for the
    CUDA device's name; None when unknown (e.g. CPU), in which case MFU is reported as n/a."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    flops = peak_bf16_flops(name)
    if flops is not None:
        return flops
    logger.warning("metrics: peak FLOP/s of %r unknown; set metrics.peak_flops for MFU", name)
    return None


def peak_bf16_flops(device_name: str) -> float | None:
    """Dense bf16 FLOP/s of the device whose name contains a table key (e.g. "NVIDIA H100 80GB
    HBM3" or "H100"), the first match in table order; None when no key matches."""
    for key, flops in _PEAK_BF16_FLOPS:
        if key in device_name:
            return flops
    return None
