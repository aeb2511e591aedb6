"""torchao's float8 grouped-GEMM Triton kernels, stood in for pricing a GPU step on fake CPU
tensors (the ledger): the four scale-and-cast kernels `torchao.prototype.moe_training.
fp8_grouped_mm` calls around `torch._scaled_grouped_mm` (whose fake implementation torch has).

Each stand-in is a `titanlab::` op with the outputs of torchao's kernel (their fake
implementations in torchao's `kernels/float8_rowwise.py` and `kernels/jagged_float8_scales.py`:
the float8 data in the layout the GEMM takes, and float32 scales), so the ledger records one
memory-bound kernel each, reading the high-precision tensor and writing its float8 copy and
scales. On a CPU without Triton torchao defines those kernels as functions that raise; inside
`torchao_kernels_priced()` its module calls these instead. Fake tensors only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_FAKE_ONLY = "titanlab's stand-ins for torchao's float8 kernels price fake tensors only"


def _col_major_3d(e: int, k: int, n: int, dtype, device) -> torch.Tensor:
    return torch.empty((e, k, n), dtype=dtype, device=device).as_strided((e, k, n), (k * n, 1, k))


@torch.library.custom_op("titanlab::fp8_rowwise_2d_scale_and_cast", mutates_args=())
def rowwise_2d(
    x: torch.Tensor, output_dtype: torch.dtype, round_scales_to_power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) → (float8 (M, K) row-major, scales (M, 1) float32): one scale a row."""
    raise NotImplementedError(_FAKE_ONLY)


@rowwise_2d.register_fake
def _(x, output_dtype, round_scales_to_power_of_2=False):
    m, k = x.shape
    return x.new_empty((m, k), dtype=output_dtype), x.new_empty((m, 1), dtype=torch.float32)


@torch.library.custom_op("titanlab::fp8_colwise_3d_scale_and_cast", mutates_args=())
def colwise_3d(
    w: torch.Tensor, output_dtype: torch.dtype, round_scales_to_power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, K, N) → (float8 (E, K, N) column-major, scales (E, 1, N)): one a column."""
    raise NotImplementedError(_FAKE_ONLY)


@colwise_3d.register_fake
def _(w, output_dtype, round_scales_to_power_of_2=False):
    e, k, n = w.shape
    scales = w.new_empty((e, 1, n), dtype=torch.float32)
    return _col_major_3d(e, k, n, output_dtype, w.device), scales


@torch.library.custom_op("titanlab::fp8_rowwise_3d_transpose_rhs", mutates_args=())
def transpose_rhs(
    w: torch.Tensor, output_dtype: torch.dtype, round_scales_to_power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """w (E, K, N) → (float8 (E, N, K) column-major, scales (E, K)): the backward's operand."""
    raise NotImplementedError(_FAKE_ONLY)


@transpose_rhs.register_fake
def _(w, output_dtype, round_scales_to_power_of_2=False):
    e, k, n = w.shape
    data = torch.empty((e, n, k), dtype=output_dtype, device=w.device)
    return data.as_strided((e, n, k), (n * k, 1, n)), w.new_empty((e, k), dtype=torch.float32)


@torch.library.custom_op("titanlab::fp8_per_group_colwise_scales_dual", mutates_args=())
def per_group_dual(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    output_dtype: torch.dtype,
    round_scales_to_power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """a (M, N1), b (M, N2), offsets (G,) → each in float8 column-major with scales per token
    group and column ((N · G,) float32): the weight gradient's operands."""
    raise NotImplementedError(_FAKE_ONLY)


@per_group_dual.register_fake
def _(a, b, offsets, output_dtype, round_scales_to_power_of_2=False):
    m, groups = a.shape[0], offsets.numel()

    def col_major(t):
        return torch.empty_like(t, dtype=output_dtype).as_strided(t.size(), (1, m))

    return (col_major(a), a.new_empty((a.shape[1] * groups,), dtype=torch.float32),
            col_major(b), b.new_empty((b.shape[1] * groups,), dtype=torch.float32))  # fmt: skip


STAND_INS = {
    "triton_fp8_rowwise_2d_scale_and_cast": rowwise_2d,
    "triton_fp8_colwise_3d_scale_and_cast": colwise_3d,
    "triton_fp8_rowwise_3d_transpose_rhs": transpose_rhs,
    "triton_fp8_per_group_colwise_scales_dual": per_group_dual,
}
"""torchao's kernel name → its stand-in."""


@contextlib.contextmanager
def torchao_kernels_priced() -> Iterator[None]:
    """Inside, torchao's float8 grouped GEMM calls the stand-ins (no-op without torchao)."""
    try:
        from torchao.prototype.moe_training import fp8_grouped_mm
    except ImportError:
        yield
        return
    originals = {name: getattr(fp8_grouped_mm, name) for name in STAND_INS}
    for name, op in STAND_INS.items():
        setattr(fp8_grouped_mm, name, op)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(fp8_grouped_mm, name, fn)
