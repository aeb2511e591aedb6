"""float8 for the routed experts: their grouped GEMMs in float8 with per-row scales, through
torchao (`torchao.prototype.moe_training`, `Float8TrainingOpConfig`), applied as a model
converter beside `titanlab.precision.float8`'s Linear layers.

Each SwiGLU `GroupedExperts` module's w1, w2 and w3 become torchao's
`Float8TrainingWeightWrapperTensor`, which sends `torch._grouped_mm(x, w, offs=...)` to
torchao's differentiable float8 grouped GEMM: x (tokens, dim) and w quantized to e4m3 with
dynamic scales per row of x and per output column of w (powers of 2), `torch._scaled_grouped_mm`
in forward, and in backward the input gradient the same way and the weight gradient with scales
per token group (torchao's moe_training README: the "FP8 rowwise" recipe). The wrapper is
applied before parallelize, as torchao and torchtitan apply it: expert parallel's Shard(0) and
FSDP2's all-gather (its `fsdp_pre_all_gather`) carry it. Its kernel needs every expert's group
a multiple of 16 rows, so the module pads its groups (`GroupedExperts.group_multiple`,
`titanlab.models.common.experts.pad_groups`). The experts' dims must be multiples of 16.

torchao's scaling and cast kernels are Triton's, so this runs on a GPU with float8 only: there
is no emulate mode to run on the CPU. The ledger prices them on fake tensors through their
stand-ins (`titanlab.precision.float8_experts_stand_in`).
"""

from __future__ import annotations

from torch import nn

from titanlab.config.job_config import ConfigError, Float8
from titanlab.models.common.experts import ClampedSwiGLUExperts, GroupedExperts
from titanlab.precision.float8 import float8_supported

GROUP_MULTIPLE = 16
"""Rows each expert's token group is padded to a multiple of (the float8 grouped GEMM's)."""


def float8_experts_modules(model: nn.Module) -> list[tuple[str, GroupedExperts]]:
    """(name, module) of every SwiGLU grouped-experts module of `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)]


def apply_float8_experts(model: nn.Module, cfg: Float8, device) -> int:
    """Wrap the weights of `model`'s routed experts for torchao's float8 rowwise grouped GEMM
    in place, before parallelize (no-op unless `float8.enable` and `float8.grouped_experts`).
    Returns how many experts modules were converted.

    Raises:
        ConfigError: torchao is missing; the device has no float8 (compute capability < 8.9;
            this has no emulate mode); the model has no SwiGLU grouped experts (a dense model,
            or gpt-oss's clamped experts, whose weight layout the kernel does not take); an
            expert dim that is not a multiple of 16.
    """
    if not (cfg.enable and cfg.grouped_experts):
        return 0
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_
    except ImportError:
        raise ConfigError(
            "float8.grouped_experts=true needs torchao; pip install 'titanlab[float8]'"
        ) from None
    if not float8_supported(device):
        raise ConfigError(
            "float8.grouped_experts=true needs a GPU with float8 (compute capability >= 8.9): "
            "torchao's float8 grouped GEMM runs Triton kernels and has no emulate mode; "
            "set float8.grouped_experts=false"
        )
    modules = float8_experts_modules(model)
    if not modules:
        clamped = any(isinstance(m, ClampedSwiGLUExperts) for m in model.modules())
        what = "gpt-oss's clamped experts are not covered" if clamped else "the model is dense"
        raise ConfigError(
            f"float8.grouped_experts=true needs SwiGLU grouped experts ({what}); "
            "set float8.grouped_experts=false"
        )
    for name, module in modules:
        hidden, dim = module.w1.shape[1:]
        if hidden % GROUP_MULTIPLE or dim % GROUP_MULTIPLE:
            raise ConfigError(
                f"float8.grouped_experts=true: {name} has dim {dim} and expert width {hidden}; "
                f"the float8 grouped GEMM needs both multiples of {GROUP_MULTIPLE}"
            )
    targets = {id(m) for _, m in modules}
    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda m, fqn: id(m) in targets)
    for _, module in modules:
        module.group_multiple = GROUP_MULTIPLE
    return len(modules)
