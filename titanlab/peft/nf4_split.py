"""NF4 weights split for tensor parallelism, with values equal to the whole weight's.

QLoRA quantizes each adapted weight whole (`titanlab.peft.qlora.quantize_base`): blocks of 64
consecutive weights (row-major) share an absmax, and those absmaxes are stored as int8 in
"scaler blocks" of 256 consecutive absmaxes, each with its own quantization factor, around one
mean (Dettmers et al. 2023, section 3; torchao's `NF4Tensor` layout). A tensor-parallel rank
needs the rows (column-wise layer) or the columns (row-wise layer) of its shard, dequantized to
exactly the values 1 process uses.

`nf4_shard` builds that shard as an `NF4Tensor` of its own without re-quantizing anything: the
4-bit codes of its weights, the int8 absmaxes of its blocks, the same mean, and the quantization
factor of each absmax's original scaler block. The shard's absmaxes, in its row-major order, fall
into runs that share one original scaler block; its scaler block size is the greatest common
divisor of those runs' lengths (256 when a scaler block covers whole rows, smaller otherwise),
so that every one of its scaler blocks lies inside one original block and takes that block's
factor. Dequantization (code value × (absmax / factor + mean)) is elementwise, so each weight
comes out bitwise equal to the whole tensor's.

`nf4_linear` is the base Linear of a QLoRA layer on either kind of weight: torchao's `linear_nf4`
(which saves the NF4 weight for backward, never a dequantized copy) on a plain NF4 weight, and
on the local shard of a tensor-parallel one.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

import torch

NF4_BLOCK = 64  # weights per absmax (QLoRA paper; torchao's default)
NF4_SCALER_BLOCK = 256  # absmaxes per double-quantization factor


def local_tensor(t: Any) -> Any:
    """The local shard of a DTensor (without a call torch function modes see), else `t`."""
    return getattr(t, "_local_tensor", t)


def is_quantized(t: object) -> bool:
    """Whether `t` (a tensor, parameter or DTensor) holds NF4 data. Does not import torchao:
    before something has imported it, no tensor can be NF4 (and a run without QLoRA or float8
    never pays its import, nor prints its warnings about missing CUDA kernels)."""
    if "torchao" not in sys.modules:
        return False
    try:
        from torchao.quantization import NF4Tensor
    except ImportError:
        return False
    return isinstance(local_tensor(t), NF4Tensor)


def _sub_block(shape: tuple[int, int], dim: int, parts: int) -> int:
    """The block size of every shard: the largest size that divides 64 and every offset at
    which a shard's piece of a row (or its rows) starts or ends, so that each of its blocks lies
    inside one of the whole tensor's blocks of 64 (and takes that block's absmax)."""
    rows, cols = shape
    if dim == 0:
        return math.gcd(NF4_BLOCK, rows // parts * cols)
    return math.gcd(NF4_BLOCK, cols, cols // parts)


def _shard_block_ids(
    shape: tuple[int, int], dim: int, index: int, parts: int
) -> tuple[torch.Tensor, int]:
    """(for each block of shard `index` of `parts`, in its row-major order, the id of the whole
    tensor's block of 64 that holds it; the shard's block size)."""
    rows, cols = shape
    block = _sub_block(shape, dim, parts)
    grid = torch.arange(rows * cols // block).view(rows, cols // block)
    return grid.chunk(parts, dim=dim)[index].flatten() * block // NF4_BLOCK, block


@functools.lru_cache(maxsize=64)
def shard_layout(shape: tuple[int, int], dim: int, parts: int) -> tuple[int, int]:
    """(block size, scaler block size) of every shard of a (rows, cols) NF4 weight split into
    `parts` on `dim` (the same for each shard). The scaler block size is the gcd of the lengths
    of the runs of the shard's blocks that share one original scaler block. Needs
    `split_problem(...)` to be None."""
    sizes = []
    for index in range(parts):
        ids, block = _shard_block_ids(shape, dim, index, parts)
        scaler_blocks = ids // NF4_SCALER_BLOCK
        change = torch.nonzero(scaler_blocks[1:] != scaler_blocks[:-1]).flatten() + 1
        edges = [0, *change.tolist(), scaler_blocks.numel()]
        sizes.append(functools.reduce(math.gcd, (b - a for a, b in zip(edges, edges[1:]))))
    return block, functools.reduce(math.gcd, sizes)


def split_problem(name: str, shape: tuple[int, ...], dim: int, parts: int) -> str | None:
    """Why the 2-D NF4 weight `name` of `shape` cannot be split into `parts` equal shards on
    `dim` (0: rows, column-wise TP; 1: columns, row-wise TP), or None. The split must be even
    and leave the two 4-bit codes of each byte on one rank."""
    rows, cols = shape
    if shape[dim] % parts or _sub_block((rows, cols), dim, parts) % 2:
        return (
            f"{name} ({rows}×{cols}) cannot be stored as NF4 over {parts} tensor-parallel "
            f"ranks: its {'rows' if dim == 0 else 'columns'} must split into equal, even "
            "counts of weights"
        )
    return None


def shard_problem(
    name: str, shape: tuple[int, ...], shards: int, tp: int = 1, tp_dim: int = 0
) -> str | None:
    """Why the weight `name` of `shape`, split into `tp` tensor-parallel shards on `tp_dim`,
    cannot be stored as NF4 split into `shards` FSDP row blocks, or None. torchao quantizes
    whole blocks of 64·256 weights, and FSDP2 splits NF4 data only into equal row blocks that
    each hold whole scaler blocks (of the tensor-parallel shard's layout, `shard_layout`)."""
    numel, unit = math.prod(shape), NF4_BLOCK * NF4_SCALER_BLOCK
    if len(shape) != 2 or numel % unit:
        return (
            f"{name} ({'×'.join(map(str, shape))}) cannot be stored as NF4: it must be 2-D and "
            f"hold a multiple of {unit} weights ({NF4_BLOCK}·{NF4_SCALER_BLOCK})"
        )
    rows, cols = shape
    if tp > 1:
        problem = split_problem(name, shape, tp_dim, tp)
        if problem:
            return problem
    block, scaler_block = shard_layout((rows, cols), tp_dim, tp) if tp > 1 else (64, 256)
    local_rows = rows // tp if tp_dim == 0 else rows
    per_shard = block * scaler_block
    if local_rows % shards or (numel // tp) % (per_shard * shards):
        over = f"{shards} FSDP shard{'s' if shards > 1 else ''}"
        if tp > 1:
            over += f" of each of its {tp} tensor-parallel shards"
        return (
            f"{name} ({rows}×{cols}) cannot be stored as NF4 over {over}: its rows must "
            f"split evenly and each shard must hold a multiple of {per_shard} weights "
            f"({block}·{scaler_block})"
        )
    return None


def nf4_shard(weight, dim: int, index: int, parts: int):
    """Shard `index` of `parts` of the 2-D `NF4Tensor` `weight`, split on `dim`, as an
    `NF4Tensor` whose dequantized values equal those of the same slice of `weight` bitwise
    (module docstring). `split_problem` must have returned None for its shape."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (
        NF4Tensor,
        SubclassTensorArgs,
    )

    shape = (weight.shape[0], weight.shape[1])
    assert weight.block_size == NF4_BLOCK and weight.scaler_block_size == NF4_SCALER_BLOCK
    ids, block = _shard_block_ids(shape, dim, index, parts)
    ids = ids.to(weight.quantized_scalers.device)
    _, scaler_block = shard_layout(shape, dim, parts)
    codes = weight.quantized_data.view(shape[0], shape[1] // 2).chunk(parts, dim=dim)[index]
    local = list(shape)
    local[dim] //= parts
    meta = SubclassTensorArgs(
        torch.Size(local), (local[1], 1), 0, weight.dtype, weight.device, False
    )
    return NF4Tensor(
        meta,
        block,
        ids.numel(),
        scaler_block,
        weight.quantized_scalers[ids].contiguous(),
        weight.quantization_factor[ids[::scaler_block] // NF4_SCALER_BLOCK].contiguous(),
        weight.scaler_mean,
        codes.contiguous().flatten(),
        weight.nf4,
    )


def nf4_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x Wᵀ for an NF4 weight W, plain or a tensor-parallel DTensor (one mesh dimension).

    Shapes: x (..., in) → (..., out) in x's dtype. Under TP, x arrives as the style prepares it
    (replicated for a column-wise W, sharded on its last dim for a row-wise one) and the result
    is a DTensor sharded on its last dim (column-wise) or a partial sum (row-wise), as
    `F.linear` of DTensors would give; the NF4 shard is dequantized in forward and again in
    backward, never saved dequantized.
    """
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

    local = local_tensor(weight)
    if local is weight:
        return linear_nf4(x, weight)
    from torch.distributed.tensor import DTensor, Partial, Shard

    assert isinstance(weight, DTensor)
    colwise = weight.placements == (Shard(0),)
    if isinstance(x, DTensor):
        # Column-wise: x is replicated and each rank's x-gradient covers only its output rows,
        # a partial sum; row-wise: x's gradient is sharded on its last dim like x.
        x = x.to_local(grad_placements=[Partial()] if colwise else None)
    y = linear_nf4(x, local)
    out = Shard(y.ndim - 1) if colwise else Partial()
    return DTensor.from_local(y, weight.device_mesh, [out], run_check=False)
