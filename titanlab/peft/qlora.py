"""QLoRA: LoRA over a base whose adapted Linear weights are stored in 4-bit NormalFloat (NF4)
(Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"), through torchao's
`NF4Tensor` (`torchao.quantization.to_nf4`).

NF4 stores each weight as a 4-bit index into 16 normal-distribution quantiles, scaled by the
absmax of its block of 64 weights; the absmaxes are themselves quantized to int8 in blocks of 256
around their mean ("double quantization"). That is 4 + 8/64 + 32/(64·256) ≈ 4.13 bits per weight,
0.26 of bf16.

Order of operations (the trainer's): `apply_lora` on the meta-device model, then
`quantize_base` reads each adapted Linear's full weight from the base checkpoint, quantizes it
whole (so the values do not depend on the layout) and makes it a frozen NF4 parameter; FSDP2
then shards it (torchao's NF4Tensor implements FSDP2's all-gather extension: the packed data
and scales are what move) and each block dequantizes its weights in forward, in the input's
dtype. `to_empty_keeping_quantized` materializes everything else; initialization leaves the
quantized weights alone (`hide_quantized`); checkpoints never hold NF4 (step checkpoints
hold adapters, a model export the dequantized base).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from titanlab.config.errors import ConfigError
from titanlab.peft.lora import LoRALinear
from titanlab.peft.nf4_split import (
    NF4_BLOCK,
    NF4_SCALER_BLOCK,
    is_quantized,
    local_tensor,
    shard_problem,
)

_LAYER = re.compile(r"^(layers\.\d+)\.")


def dequantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` with NF4 data turned back into `dtype` values (a DTensor stays a DTensor with the
    same placements, each rank dequantizing its own rows); any other tensor unchanged."""
    if not is_quantized(t):
        return t
    local = local_tensor(t)
    plain = local.get_original_weight().to(dtype)  # type: ignore[attr-defined]
    if local is t:
        return plain
    from torch.distributed.tensor import DTensor

    assert isinstance(t, DTensor)
    return DTensor.from_local(
        plain, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False
    )


def quantize_base(
    model: nn.Module,
    path: str,
    shards: int,
    device: torch.device | str = "cpu",
    tp: int = 1,
    tp_split: dict[str, int] | None = None,
) -> int:
    """Make the base weight of every `LoRALinear` of the meta-device `model` a frozen NF4
    parameter on `device`, quantized from the full weight stored in the DCP checkpoint `path`.

    Weights are read one transformer block at a time (the full tensors of one block in memory).

    Args:
        model: the model after `apply_lora`, still on the meta device, before parallelism.
        path: a DCP checkpoint folder holding the base (`checkpoint.initial_load_path`).
        device: where the NF4 weights live; "meta" (a dry run) checks the stored names and
            shapes but reads no weight.
        shards: how many ranks FSDP will shard these weights over (1 without FSDP).
        tp, tp_split: the tensor-parallel degree, and the dim it splits each module's weight on
            (`titanlab.distributed.tensor_parallel.one_d.linear_split_dims`; a module not named is
            not split). Each rank still quantizes the whole weight; the TP styles then keep
            its shard (`titanlab.peft.nf4_split.nf4_shard`).
    Returns:
        the number of weights quantized.
    Raises:
        ConfigError: one line when a weight is missing from `path`, has another shape, or
            cannot be split into `tp` × `shards` NF4 shards (`shard_problem`).
    """
    from torchao.quantization import to_nf4

    stored = FileSystemReader(path).read_metadata().state_dict_metadata
    targets = {
        name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)
    }
    groups: dict[str, list[str]] = {}
    for name, module in targets.items():
        key = f"model.{name}.weight"
        meta = stored.get(key)
        if meta is None or not hasattr(meta, "size"):
            raise ConfigError(
                f"checkpoint.initial_load_path={path!r} holds no {key}; peft.quantize_base "
                "needs the base model's weights there"
            )
        shape = tuple(module.weight.shape)
        if tuple(meta.size) != shape:
            raise ConfigError(
                f"checkpoint.initial_load_path={path!r}: {key} is {tuple(meta.size)}, the "
                f"model's is {shape}; it is not a checkpoint of this model"
            )
        dim = (tp_split or {}).get(name)
        split = (tp, dim) if tp > 1 and dim is not None else (1, 0)
        problem = shard_problem(name + ".weight", shape, shards, *split)
        if problem:
            raise ConfigError(
                f"peft.quantize_base=nf4: {problem}; use fewer FSDP or TP ranks or other targets"
            )
        m = _LAYER.match(name)
        groups.setdefault(m.group(1) if m else name, []).append(name)
    dry = torch.device(device).type == "meta"  # a dry run: shapes only, nothing read
    for names in groups.values():
        full = {
            name: torch.empty(
                tuple(stored[f"model.{name}.weight"].size),  # type: ignore[union-attr]
                dtype=stored[f"model.{name}.weight"].properties.dtype,  # type: ignore[union-attr]
                device="meta" if dry else "cpu",
            )
            for name in names
        }
        if not dry:
            dcp.load({"model": {f"{n}.weight": t for n, t in full.items()}}, checkpoint_id=path)
        for name, weight in full.items():
            nf4 = to_nf4(weight.to(device), NF4_BLOCK, NF4_SCALER_BLOCK)
            targets[name].weight = nn.Parameter(nf4, requires_grad=False)
    return len(targets)


def to_empty_keeping_quantized(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module.to_empty(device=device)`, except that NF4 weights (already real) are kept."""
    return module._apply(
        lambda t: t if is_quantized(t) else torch.empty_like(t, device=device), recurse=True
    )


@contextlib.contextmanager
def hide_quantized(model_parts: list[nn.Module]) -> Iterator[None]:
    """Within this context every NF4 parameter is replaced by an empty (0-element) one, so a
    model's `init_weights` leaves the quantized weights (which come from the base checkpoint)
    alone and initializes everything else as usual; the NF4 parameters are put back after."""
    hidden = []
    for part in model_parts:
        for module in part.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and is_quantized(p):
                    hidden.append((module, name, p))
                    empty = torch.empty(0, device=local_tensor(p).device)
                    module._parameters[name] = nn.Parameter(empty, requires_grad=False)
    try:
        yield
    finally:
        for module, name, p in hidden:
            module._parameters[name] = p


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this rank stores for `t` (its local shard; NF4's packed data and scales)."""
    local = local_tensor(t)
    if is_quantized(local):
        inner, _ = local.__tensor_flatten__()
        return sum(getattr(local, n).numel() * getattr(local, n).element_size() for n in inner)
    return local.numel() * local.element_size()


def quantized_bytes(model_parts: list[nn.Module]) -> tuple[int, int]:
    """(bytes this rank stores for its NF4 weights, their element count on this rank)."""
    quantized = [p for part in model_parts for p in part.parameters() if is_quantized(p)]
    return sum(map(tensor_bytes, quantized)), sum(local_tensor(p).numel() for p in quantized)


def adapted_base_bytes(model_parts: list[nn.Module]) -> int:
    """Bytes this rank stores for the base weights under the LoRA adapters (NF4 or not)."""
    return sum(
        tensor_bytes(m.weight)
        for part in model_parts
        for m in part.modules()
        if isinstance(m, LoRALinear)
    )
