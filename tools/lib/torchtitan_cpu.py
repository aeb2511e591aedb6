"""torchtitan 0.2.2 on a machine without CUDA: its import reads the device once, and its one
triton module (the MoE permutation kernel) needs a GPU build of torch. For the CPU rows of
`tools/benchmark_torchtitan.py` and the per-op ledger's A/B (`tools/lib/torchtitan_ledger.py`).
torchtitan is a peer for benchmarks only: titanlab never imports it."""

from __future__ import annotations

import os
import sys


class CpuDevice:
    """The calls torchtitan 0.2.2 makes on `torch.cuda` (its `device_module`), answered for a
    CPU: one device, no caching allocator (its peak statistics empty), nothing to wait for."""

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return type("Properties", (), {"total_memory": pages * size})()

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def synchronize(device=None) -> None:
        pass


def use_cpu() -> None:
    """Import torchtitan bound to the CPU (`CpuDevice`): its modules read the device type and
    module once, at import, from `torch._utils`, which answers so only for the import. Without
    triton (a CPU build of torch), torchtitan's one triton module, the MoE token permutation
    kernel (unused by a dense model), is replaced by one whose function says so."""
    import importlib.util
    import types

    import torch._utils as tu

    if importlib.util.find_spec("triton") is None:
        kernels = types.ModuleType("torchtitan.models.moe.kernels")
        kernels.generate_permute_indices = _no_triton  # type: ignore[attr-defined]
        sys.modules[kernels.__name__] = kernels
    device_type, device_module = tu._get_available_device_type, tu._get_device_module
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda name=None: (
        CpuDevice if name in (None, "cpu") else device_module(name)
    )
    try:
        import torchtitan.train  # noqa: F401
    finally:
        tu._get_available_device_type, tu._get_device_module = device_type, device_module


def _no_triton(*args, **kwargs):
    raise RuntimeError("torchtitan's MoE permutation kernel needs triton, absent on this CPU")
