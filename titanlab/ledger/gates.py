"""The ledger's checks of a step's GPU code path (docs/ledger.md, "Gates"), each a number and
what it names:

- `fp32_gemm_share`: the share of GEMM FLOPs (matmuls and attention) computed in fp32, by
  module, against all GEMM FLOPs; a bf16 or float8 run keeps it at most 1%, where the MoE
  routers' fp32 scores (`EXEMPT`) are the allowed exceptions. The fused loss's weight gradient
  summed as fp32 GEMMs (the defect of 2026-11-27: 8.6 TFLOP a step for Llama 3 8B at seq_len
  8192) was 30% of the step's GEMM FLOPs on 11 blocks.
- `attention_matrices`: the tensors an attention op (or the step's mask building) makes with a
  (queries × keys) plane of a whole sequence, seq_len/cp × seq_len or more: a score matrix, a
  dense mask or its additive bias. A fused attention kernel (flash, cuDNN, FlexAttention's
  block-sparse one) makes none; none above 64 MiB may exist.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from titanlab.ledger.run import Ledger

MAX_FP32_GEMM_SHARE = 0.01
EXEMPT = ("router",)
"""Module names whose fp32 GEMMs are by design: an MoE router scores tokens in fp32 (Qwen3-MoE,
DeepSeek-V3, gpt-oss as published), a (tokens × dim) by (dim × experts) product."""


def fp32_gemm_share(ledger: Ledger) -> tuple[float, dict[str, float]]:
    """(share of all GEMM FLOPs computed in fp32 outside `EXEMPT` modules, {module: its share}
    for every module with fp32 GEMMs, exempt ones included)."""
    total = 0
    fp32: dict[str, int] = defaultdict(int)
    for op in ledger.ops:
        if op.kind not in ("gemm", "attention"):
            continue
        total += op.flops
        if op.dtype in ("float32", "float64"):
            fp32[op.module] += op.flops
    total = total or 1
    by_module = {m: f / total for m, f in sorted(fp32.items(), key=lambda kv: -kv[1])}
    counted = sum(s for m, s in by_module.items() if not any(e in m for e in EXEMPT))
    return counted, by_module


MAX_ATTENTION_MATRIX_BYTES = 64 * 2**20


def attention_matrices(ledger: Ledger, limit: int = MAX_ATTENTION_MATRIX_BYTES) -> list[str]:
    """Each op output above `limit` bytes whose last two dims are a (queries × keys) plane of a
    whole sequence: both between seq_len / cp and seq_len + 1 (a sink's extra key), made in an
    attention module or outside every module (where the step builds its masks); as
    "op module phase shape dtype MiB". Hidden states (seq × dim) would match only where dim
    falls in that range, which no shipped flavor's does at seq_len 8192."""
    rows = ledger.seq_len // max(ledger.cp, 1)
    found = []
    for op in ledger.ops:
        if op.kind == "view" or len(op.shape) < 2 or not op.dtype:
            continue
        if "attention" not in op.module and op.module != "":
            continue
        q, k = op.shape[-2:]
        if not (rows <= q <= ledger.seq_len + 1 and rows <= k <= ledger.seq_len + 1):
            continue
        size = (
            torch.Size(op.shape).numel()
            * torch.empty((), dtype=getattr(torch, op.dtype)).element_size()
        )
        if size > limit:
            found.append(f"{op.op} {op.module or '-'} {op.phase} {tuple(op.shape)} {op.dtype} "
                         f"{size / 2**20:.0f} MiB")  # fmt: skip
    return found
