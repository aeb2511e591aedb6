"""Calibration of what FSDP2 costs per collective beyond its α–β time.

FSDP2 (`fully_shard`) moves each unit's parameters through a flat buffer: copied in,
all-gathered, copied out into the unsharded parameters; its gradients the same way into a
reduce-scatter, then back into sharded DTensor gradients. That per-unit work, and on CPU ranks
sharing cores the hand-off of the core at every blocking collective, is in neither the FLOPs nor
the bytes. titanlab's DDP is FSDP2's `replicate` (one all-reduce per unit, no copies of the
parameters), which the α–β model prices as the same bytes and latency as an all-gather plus a
reduce-scatter; measured here (torch 2.13, 4 ranks on 2 cores) ZeRO 2 ran 10% and ZeRO 3 25%
slower than DDP on the debug model, where the model had them level.

`fsdp_step_seconds` times a model of a few blocks (`blocks_of`) forward and backward under `replicate`,
under `fully_shard` keeping the parameters gathered through backward (ZeRO 2: one all-gather
and one reduce-scatter per unit) and under `fully_shard` resharding after forward (ZeRO 3: the
blocks and the embedding gathered again for backward), in interleaved triples, on one group of
every rank (as FSDP's dp group is in training). `fsdp_overheads` solves for the seconds one
all-gather and one reduce-scatter take beyond the α–β model (`Cluster.fsdp_gather_s`,
`Cluster.fsdp_reduce_s`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import cast

import torch
from torch import nn

from titanlab.models.common.shortened import shortened

BLOCKS = 4
"""Blocks of the timed model (at most the job's): + 2 FSDP units, the embedding and the norm +
output. Measured here (4 ranks on 2 cores, 25 triples each, twice): a unit's all-gather +
reduce-scatter beyond the α–β time came out 5.5 and 8.0 ms with 2 blocks, 7.0 and 8.1 ms with 4,
against 8.2 ms in the whole 6-block debug model's forward and backward."""
REPEATS = 20


def fsdp_step_seconds(
    model_args, tokens: int, seq: int, dtype, device, group
) -> tuple[float, float]:
    """(ZeRO 2 − DDP, ZeRO 3 − ZeRO 2): seconds one forward + backward of a `blocks_of`-block
    model over `tokens` tokens per rank, data parallel over `group`, takes more under the one
    than the other; each the median of `REPEATS` differences within interleaved triples (a
    drift of the machine falls on both sides). Every rank of `group` must call it at once."""
    from torch.distributed.device_mesh import DeviceMesh

    from titanlab.distributed.parallelize import apply_ddp, apply_fsdp
    from titanlab.models.common.decoder import Decoder
    from titanlab.models.registry import build_model

    args = dataclasses.replace(shortened(model_args, blocks_of(model_args)), max_seq_len=seq)
    mesh = DeviceMesh.from_group(group, device.type)
    models = []
    for wrap in ("ddp", "zero2", "zero3"):
        torch.manual_seed(0)
        with torch.device(device):
            model = cast("Decoder", build_model(args))
        if wrap == "ddp":
            apply_ddp(model, mesh, param_dtype=dtype, reduce_dtype=torch.float32)
        else:
            apply_fsdp(model, mesh, param_dtype=dtype, reduce_dtype=torch.float32,
                       cpu_offload=False, pin_memory=False,
                       reshard_after_forward=wrap == "zero3")  # fmt: skip
        models.append(model)
    batch = max(tokens // seq, 1)
    ids = torch.randint(0, args.vocab_size, (batch, seq), device=device)

    def timed(model) -> float:
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        model(ids).float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - begin

    for model in models:  # warm-up: the first collectives connect
        timed(model)
    triples = [[timed(m) for m in models] for _ in range(REPEATS)]
    return (statistics.median(zero2 - ddp for ddp, zero2, _ in triples),
            statistics.median(zero3 - zero2 for _, zero2, zero3 in triples))  # fmt: skip


def blocks_of(model_args) -> int:
    """Blocks of the timed model: `BLOCKS`, or the job's model's blocks when fewer."""
    return min(BLOCKS, model_args.n_layers)


def unit_params(model_args) -> list[int]:
    """Parameters of each FSDP unit of the timed model, as `apply_fsdp` groups them: its blocks
    (`blocks_of`), the embedding, then the norm + output (last)."""
    from titanlab.models.common.counting import count_params
    from titanlab.planning.memory import _meta_model

    model = _meta_model(shortened(model_args, blocks_of(model_args)))
    layers = cast(nn.ModuleDict, model.layers)
    embedding, norm, output = (
        cast(nn.Module, m) for m in (model.tok_embeddings, model.norm, model.output)
    )
    return [
        *(count_params(b) for b in layers.values()),
        count_params(embedding),
        count_params(nn.ModuleList([norm, output])),
    ]


def fsdp_overheads(added: tuple[float, float], n: int, units: list[int], param_bytes: int,
                   grad_bytes: int, alpha: float, beta: float) -> tuple[float, float]:  # fmt: skip
    """(seconds per all-gather, seconds per reduce-scatter) FSDP2 takes beyond the α–β model
    (`titanlab.planning.comm_model`: over a ring of n ranks an all-gather or reduce-scatter of
    M bytes (n − 1)·α + (n − 1)/n · M / β, an all-reduce twice that), from what
    `fsdp_step_seconds` measured ZeRO 2 adding to DDP and ZeRO 3 to ZeRO 2 on a model whose
    FSDP units hold `units` parameters each (`unit_params`: the norm + output last):
    - ZeRO 3 − ZeRO 2: every unit but the norm + output (never resharded) gathered again;
    - ZeRO 2 − DDP: each unit's all-gather and reduce-scatter against `replicate`'s all-reduces,
      one per block and one for the root's embedding, norm and output together.
    Each ≥ 0."""
    zero2_over_ddp, zero3_over_zero2 = added
    u = len(units)

    from titanlab.planning.comm_model import ring_seconds

    def ring(kind: str, calls: int, params: int, nbytes: int) -> float:  # `params` over `calls`
        return ring_seconds(kind, n, params * nbytes / calls, calls, alpha, beta)

    regathered = ring("all-gather", u - 1, sum(units[:-1]), param_bytes)
    zero2 = ring("all-gather", u, sum(units), param_bytes)
    zero2 += ring("reduce-scatter", u, sum(units), grad_bytes)
    ddp = ring("all-reduce", u - 1, sum(units), grad_bytes)
    per_gather = max(0.0, (zero3_over_zero2 - regathered) / (u - 1))
    per_reduce = max(0.0, (zero2_over_ddp - (zero2 - ddp)) / u - per_gather)
    return per_gather, per_reduce
