"""float8 training through torchao (`convert_to_float8_training`), applied as a model converter.

The Linear layers of the meta-device model are swapped for torchao's Float8Linear before
parallelize: their matmuls run in float8 (e4m3 forward, e5m2 gradients) with dynamic scales —
tensorwise, rowwise, or rowwise with the weight gradient in high precision (recipes of
torchao's float8 README). The output projection (`float8.filter_fqns`) and any Linear whose
dims are not multiples of 16 (a float8 GEMM requirement) stay in high precision. torchao is an
optional dependency (`pip install 'titanlab[float8]'`). On CPU, or GPUs without float8 (compute
capability < 8.9), it runs only in torchao's emulate mode, which computes the same numerics with
ordinary matmuls (for testing, not speed).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from titanlab.config.device_path import device_capability, device_type
from titanlab.config.job_config import ConfigError, Float8


def float8_supported(device: torch.device) -> bool:
    """Whether `device` has float8 tensor cores (NVIDIA compute capability >= 8.9; on a
    target's code path, `titanlab.config.device_path`, the target's)."""
    return device_type(device) == "cuda" and device_capability(device) >= (8, 9)


def _linear_filter(filter_fqns: list[str]):
    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if any(f in fqn for f in filter_fqns):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    return keep


def apply_float8(model: nn.Module, cfg: Float8, device: torch.device, fsdp_enabled: bool) -> None:
    """Convert `model`'s Linear layers to float8 training in place (no-op unless enabled).

    Raises:
        ConfigError: torchao is missing, or the device has no float8 and `float8.emulate` is off.
    """
    if not cfg.enable:
        return
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError(
            "float8.enable=true needs torchao; pip install 'titanlab[float8]'"
        ) from None
    if not cfg.emulate and not float8_supported(device):
        raise ConfigError(
            f"float8.enable=true needs a GPU with float8 (compute capability >= 8.9), "
            f"not {device.type}; set float8.emulate=true to test the numerics"
        )
    config = Float8LinearConfig.from_recipe_name(cfg.recipe_name)
    config = dataclasses.replace(
        config,
        emulate=cfg.emulate,
        enable_fsdp_float8_all_gather=(
            cfg.enable_fsdp_float8_all_gather and fsdp_enabled and cfg.recipe_name == "tensorwise"
        ),
    )
    convert_to_float8_training(
        model, config=config, module_filter_fn=_linear_filter(cfg.filter_fqns)
    )


def precompute_scales(model_parts: list[nn.Module], cfg: Float8, fsdp_enabled: bool) -> None:
    """After the optimizer step: compute all float8 weight scales in one all-reduce (tensorwise
    recipe with float8 FSDP all-gather), instead of one per layer during the next forward."""
    if (
        cfg.enable
        and cfg.recipe_name == "tensorwise"
        and cfg.enable_fsdp_float8_all_gather
        and cfg.precompute_float8_dynamic_scale_for_fsdp
        and fsdp_enabled
    ):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
