"""Calibration of what tensor parallel costs beyond its FLOPs and its collectives' α–β time.

A sequence-parallel TP block (`titanlab.distributed.tensor_parallel.plan`) runs every op through
DTensor's dispatch (sharding propagation, redistributions) and splits each GEMM tp ways, smaller and
slower; on CPU ranks sharing cores, each blocking collective also hands the core away. None of
that is in the FLOPs or the bytes. `tp_block_seconds` times one block's forward and backward
under TP within a group of ranks, and the same block unsplit, with every rank of the machine
doing the same at once (as they do in training); the calibration keeps what TP adds beyond
half the unsplit time and its collectives' modelled time (`Cluster.tp_block_s`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import cast

import torch
from torch import nn

REPEATS = 15


def tp_block_seconds(
    model_args, tokens: int, seq: int, dtype, device, group
) -> tuple[float, float]:
    """(seconds of one block's forward + backward over `tokens` tokens, sequence-parallel TP
    over `group`; seconds of the same block unsplit on this rank): medians of `REPEATS`
    interleaved pairs. Every rank of `group` must call it at once."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    from titanlab.distributed.tensor_parallel.one_d import _block_plan
    from titanlab.models.common.shortened import shortened
    from titanlab.models.registry import build_model

    args = dataclasses.replace(shortened(model_args, 1), max_seq_len=seq)
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(args).to(dtype)
        split = build_model(args).to(dtype)
    block = cast(nn.ModuleDict, model.layers)["0"]
    block_tp = cast(nn.ModuleDict, split.layers)["0"]
    mesh = DeviceMesh.from_group(group, device.type)
    plan = _block_plan(split, block_tp, ColwiseParallel, RowwiseParallel, PrepareModuleInput)  # type: ignore[arg-type]
    parallelize_module(block_tp, mesh, plan)
    n = mesh.size()
    batch = max(tokens // seq, 1)
    cos, sin = cast(torch.Tensor, model.rope_cos)[:seq], cast(torch.Tensor, model.rope_sin)[:seq]
    x = torch.randn(batch, seq, args.dim, device=device, dtype=dtype, requires_grad=True)
    x_local = torch.randn(batch, seq // n, args.dim, device=device, dtype=dtype, requires_grad=True)

    def timed(tp: bool) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        if tp:
            out = block_tp(DTensor.from_local(x_local, mesh, [Shard(1)]), cos, sin)
            out = out.to_local() if isinstance(out, DTensor) else out
        else:
            out = block(x, cos, sin)
        out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - begin

    timed(True), timed(False)  # warm-up
    pairs = [(timed(True), timed(False)) for _ in range(REPEATS)]
    return statistics.median(t for t, _ in pairs), statistics.median(p for _, p in pairs)


def tp_overhead_s(t_tp: float, t_plain: float, n: int, tokens: int, dim: int, elem: int,
                  alpha: float, beta: float) -> float:  # fmt: skip
    """What a TP block's forward + backward takes beyond its share of the unsplit block's time
    (t_plain / n) and its collectives as the performance model prices them: 4 all-gathers and 4
    reduce-scatters of the (tokens, dim) activations over n ranks, each (n − 1)·α +
    (n − 1)/n · M / β (Korthikanti et al. 2022; `titanlab.planning.comm_model`). ≥ 0."""
    from titanlab.planning.comm_model import ring_seconds

    nbytes = tokens * dim * elem
    collectives = sum(ring_seconds(k, n, nbytes, 4, alpha, beta)
                      for k in ("all-gather", "reduce-scatter"))  # fmt: skip
    return max(0.0, t_tp - t_plain / n - collectives)
