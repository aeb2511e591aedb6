"""The trainer's LoRA / QLoRA steps, in the order it takes them: `adapt` the meta-device model,
`parallelize_fn` (QLoRA quantizes each model part's base just before its parallelisms), and
`after_parallelize`."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from titanlab.config.job_config import JobConfig
from titanlab.distributed.parallel_dims import ParallelDims
from titanlab.peft.lora import apply_lora, store_frozen_in
from titanlab.distributed.tensor_parallel.one_d import linear_split_dims
from titanlab.peft.qlora import adapted_base_bytes, quantize_base, quantized_bytes

logger = logging.getLogger(__name__)


def adapt(model: nn.Module, config: JobConfig, compute_dtype: torch.dtype) -> None:
    """LoRA adapters on the target Linears of the meta-device `model`, the rest frozen and
    stored in `compute_dtype` (a no-op without `peft.method = "lora"`)."""
    if config.peft.method != "lora":
        return
    adapted = apply_lora(model, config.peft, config.model.name)
    store_frozen_in(model, compute_dtype)
    logger.info(
        "peft: LoRA rank %d alpha %g on %d Linear layers (%s); %s trainable parameters",
        config.peft.rank, config.peft.alpha, adapted, ",".join(config.peft.target_modules),
        f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,}",
    )  # fmt: skip


def parallelize_fn(
    parallelize: Callable, config: JobConfig, dims: ParallelDims, device: torch.device
) -> Callable:
    """`parallelize` itself, or under QLoRA a function that first stores the adapted base
    weights of the model part it gets as NF4 from `checkpoint.initial_load_path` (then FSDP
    shards them)."""
    if config.peft.quantize_base != "nf4":
        return parallelize
    return functools.partial(
        _quantize_then_parallelize, parallelize=parallelize, config=config, dims=dims, device=device
    )


def _quantize_then_parallelize(
    part: nn.Module,
    parallelize: Callable,
    config: JobConfig,
    dims: ParallelDims,
    device: torch.device,
) -> None:
    path = config.checkpoint.initial_load_path
    split = linear_split_dims(part) if dims.tp > 1 else None  # type: ignore[arg-type]
    count = quantize_base(
        part, path, shards=dims.dp_shard * dims.cp, device=device, tp=dims.tp, tp_split=split
    )
    nbytes, numel = quantized_bytes([part])
    logger.info(
        "peft: %d base weights stored as NF4 (%s weights, %.2f MiB; %.3f bytes per weight)",
        count, f"{numel:,}", nbytes / 2**20, nbytes / max(numel, 1),
    )  # fmt: skip
    parallelize(part)


def after_parallelize(
    model_parts: list[nn.Module], config: JobConfig, rank: int, compute_dtype: torch.dtype
) -> None:
    """Log the bytes the adapted layers' base takes on this rank."""
    if config.peft.method != "lora":
        return
    logger.info(
        "peft: the adapted layers' base weights take %.3f MiB on rank %d (%s)",
        adapted_base_bytes(model_parts) / 2**20,
        rank,
        "NF4" if config.peft.quantize_base == "nf4" else str(compute_dtype),
    )
