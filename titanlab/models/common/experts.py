"""The routed experts of an MoE layer (`titanlab.models.common.moe`), stacked per expert.

- `GroupedExperts`: SwiGLU experts, w1, w3 (E, hidden, dim) and w2 (E, dim, hidden).
- `ClampedSwiGLUExperts`: gpt-oss's experts (OpenAI 2025, gpt-oss model card; Hugging Face's
  `GptOssExperts`), in its layout: `gate_up_proj` (E, dim, 2·hidden) with the gate and up
  columns interleaved, `down_proj` (E, hidden, dim), and biases on both; the activation clamps
  the gate above and the up part both sides at `limit`, then (up + 1) · gate · σ(α · gate).

Both run the tokens sorted by expert, with `torch._grouped_mm` where supported (Hopper bf16) or
an exact per-expert loop. Under expert parallel (applied from outside) their tensors hold a
block of E/ep experts, and `forward` receives the slots of those experts only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlab.models.common.init import trunc_normal_
from titanlab.config.device_path import device_capability, device_type


def grouped_mm_supported(x: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether `torch._grouped_mm` runs for activations like `x` computed in `dtype` (default
    x's own): bf16 on CUDA GPUs of compute capability 9.0+ (Hopper), where it is a grouped GEMM
    kernel."""
    return (
        hasattr(torch, "_grouped_mm")
        and device_type(x) == "cuda"
        and (dtype or x.dtype) == torch.bfloat16
        and device_capability(x) >= (9, 0)
    )


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype x's matmuls run in: autocast's for x's device where it is on (one device
    without FSDP: fp32 activations, bf16 GEMMs), else x's own. `torch._grouped_mm` is not on
    autocast's list, so the grouped path casts its operands to it itself."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def _grouped(module: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """The dtype of `module`'s grouped GEMMs for `x`, or None for the per-expert loop."""
    dtype = matmul_dtype(x)
    grouped = module.use_grouped_mm
    if grouped is None:
        grouped = grouped_mm_supported(x, dtype)
    return dtype if grouped else None


def _local(w: torch.Tensor) -> torch.Tensor:
    """The rank-local block of a weight that a parallelism applied from outside has wrapped in a
    sharded tensor subclass (a DTensor's `to_local()`: under expert parallel, the experts this
    rank holds), else the weight itself."""
    # Looked up on the class: Dynamo (a compiled MoE block) traces this, while
    # `getattr(w, "to_local", None)` came back None there for a DTensor parameter.
    return w.to_local() if hasattr(type(w), "to_local") else w  # type: ignore[attr-defined]


def pad_groups(
    x_td: torch.Tensor, counts: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert's group of rows padded with zero rows to a multiple of `multiple`, in static
    shapes and without a host read: x_td (T, dim) sorted by expert with `counts` (E,) int64
    rows per expert → (padded (R, dim), padded counts (E,) int64, rows (T,) int64: where each
    row of x_td went), R = T + E·(multiple − 1) rounded up to a multiple of `multiple`, the
    bound of the padded counts' sum. A grouped GEMM computes the groups only: the rows past
    their sum are left out (as torchtitan's padded permutation leaves them). A float8 grouped
    GEMM needs every group a multiple of 16 rows (torchao's
    `_to_fp8_rowwise_then_scaled_grouped_mm`)."""
    tokens, experts, m = x_td.shape[0], counts.numel(), multiple
    padded = (counts + m - 1) // m * m
    rows_total = -(-(tokens + experts * (m - 1)) // m) * m
    shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)  # group start moved by
    expert = torch.repeat_interleave(
        torch.arange(experts, device=x_td.device), counts, output_size=tokens
    )
    rows = torch.arange(tokens, device=x_td.device) + shift[expert]
    out = x_td.new_zeros(rows_total, x_td.shape[1]).index_copy(0, rows, x_td)
    return out, padded, rows


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts with stacked weights: w1, w3 (E, hidden, dim), w2 (E, dim,
    hidden); expert e computes w2[e](silu(w1[e] x) * w3[e] x) like `FeedForward`.

    Under expert parallel (applied from outside) the weights hold a block of E/ep experts and
    `forward` receives the slots of those experts only, with their counts.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.use_grouped_mm: bool | None = None
        """None: grouped GEMM where `grouped_mm_supported`, else the loop; True/False: force."""
        self.group_multiple = 1
        """The grouped GEMMs' token groups padded to a multiple of this many rows
        (`pad_groups`; 16 under float8's grouped experts, `titanlab.precision.float8_experts`)."""
        self.groups_aligned = False
        """True where the caller's groups are multiples of `group_multiple` by construction
        (expert parallel's capacity exchange), so none is padded."""

    def init_weights(self, out_std: float) -> None:
        trunc_normal_(self.w1, 0.02)
        for w in (self.w2, self.w3):
            trunc_normal_(w, out_std)

    def forward(self, x_td: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_td: (tokens, dim) sorted by expert, `counts[e]` tokens for expert e (int64, sums to
        tokens). Returns (tokens, dim) in the same order."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        dtype = _grouped(self, x_td)
        if dtype is not None:
            x_td, w1, w2, w3 = (t.to(dtype) for t in (x_td, w1, w2, w3))
            rows = None
            if self.group_multiple > 1 and not self.groups_aligned:
                x_td, counts, rows = pad_groups(x_td, counts, self.group_multiple)
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x_td, w1.transpose(-2, -1), offs=offs))
            h = h * torch._grouped_mm(x_td, w3.transpose(-2, -1), offs=offs)
            out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
            return out if rows is None else out.index_select(0, rows)
        outs = []
        for e, x in enumerate(torch.split(x_td, counts.tolist())):
            h = F.silu(x @ w1[e].t()) * (x @ w3[e].t())
            outs.append(h @ w2[e].t())
        return torch.cat(outs) if outs else x_td.new_zeros(0, w2.shape[1])


class ClampedSwiGLUExperts(nn.Module):
    """gpt-oss's experts: expert e maps x (dim,) to
    `down_proj[e]ᵀ·((u + 1) · g · σ(α g)) + down_proj_bias[e]` with `[g, u]` the even / odd
    columns of `x · gate_up_proj[e] + gate_up_proj_bias[e]`, g clamped to <= limit and u to
    [-limit, limit].

    Args:
        dim: model width; hidden_dim: one expert's SwiGLU width; num_experts: E.
        alpha, limit: the activation's sigmoid gain and clamp (gpt-oss: 1.702, 7.0).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, dim))
        self.alpha, self.limit = alpha, limit
        self.use_grouped_mm: bool | None = None
        """None: grouped GEMM where `grouped_mm_supported`, else the loop; True/False: force."""

    def init_weights(self, out_std: float) -> None:
        trunc_normal_(self.gate_up_proj, 0.02)
        trunc_normal_(self.down_proj, out_std)
        nn.init.zeros_(self.gate_up_proj_bias)
        nn.init.zeros_(self.down_proj_bias)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(.., 2·hidden) interleaved gate/up pre-activations → (.., hidden)."""
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x_td: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_td: (tokens, dim) sorted by expert, `counts[e]` tokens for expert e (int64).
        Returns (tokens, dim) in the same order."""
        w13, b13 = _local(self.gate_up_proj), _local(self.gate_up_proj_bias)
        w2, b2 = _local(self.down_proj), _local(self.down_proj_bias)
        dtype = _grouped(self, x_td)
        if dtype is not None:
            x_td, w13, w2 = (t.to(dtype) for t in (x_td, w13, w2))
            offs = counts.cumsum(0).to(torch.int32)
            expert = torch.repeat_interleave(
                torch.arange(counts.numel(), device=x_td.device), counts, output_size=x_td.shape[0]
            )
            h = self.activation(torch._grouped_mm(x_td, w13, offs=offs) + b13[expert])
            return torch._grouped_mm(h, w2, offs=offs) + b2[expert]
        outs = []
        for e, x in enumerate(torch.split(x_td, counts.tolist())):
            h = self.activation(x @ w13[e] + b13[e])
            outs.append(h @ w2[e] + b2[e])
        return torch.cat(outs) if outs else x_td.new_zeros(0, w2.shape[-1])
