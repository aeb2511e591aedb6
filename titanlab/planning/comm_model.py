"""The communication of a layout's step, per mesh dimension: which link each group uses and
the seconds of each collective in the α–β ring model (`titanlab.planning.perf_model`'s module
docstring gives the rules and their sources). Units: seconds, bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from titanlab.planning.cluster import Cluster
from titanlab.planning.layouts import Layout

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Outermost first: `ParallelDims`' mesh order; the innermost dims are the nearest ranks."""


@dataclass
class Comm:
    """One kind of collective on one mesh dimension, per step and rank."""

    kind: str
    dim: str
    group: int
    bytes: float
    """The buffer every call moves (the gathered size of an all-gather), summed over a step."""
    seconds: float
    calls: int = 1
    exposed: float = 0.0
    """Seconds of it the step waits for."""
    intra_node: bool = True


def _degrees(lay: Layout) -> dict[str, int]:
    return {"pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
            "cp": lay.cp, "tp": lay.tp}  # fmt: skip


def _on_one_node(span: int, cluster: Cluster) -> bool:
    """Whether every block of `span` consecutive ranks (aligned to `span`) lies on one node."""
    return span <= cluster.devices_per_node and cluster.devices_per_node % span == 0


def intra_node(lay: Layout, dims: tuple[str, ...], cluster: Cluster) -> bool:
    """Whether every group over `dims` (adjacent in `MESH_ORDER`) lies on one node."""
    deg = _degrees(lay)
    inner = MESH_ORDER[MESH_ORDER.index(dims[-1]) + 1 :]
    span = math.prod(deg[d] for d in inner) * math.prod(deg[d] for d in dims)
    return _on_one_node(span, cluster)


def _alpha_steps(kind: str, n: int) -> int:
    """How many α one call of `kind` over a ring of n ranks pays."""
    return {"send": 1, "all-reduce": 2 * (n - 1)}.get(kind, n - 1)


def ring_seconds(kind: str, n: int, nbytes: float, calls: int, alpha: float, beta: float) -> float:
    """Seconds of `calls` collectives of `kind` of `nbytes` each over a ring of `n` ranks, in the
    α–β model: (n−1)·α + (n−1)/n · M / β for an all-gather or reduce-scatter, an all-reduce
    twice that, a send α + M / β (Hockney 1994; Thakur et al. 2005)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    volume = {"send": 1.0, "all-reduce": 2 * (n - 1) / n}.get(kind, (n - 1) / n) * nbytes
    return calls * (_alpha_steps(kind, n) * alpha + volume / beta)


def _ring(kind: str, n: int, nbytes: float, calls: int, intra: bool, cluster: Cluster) -> float:
    """`ring_seconds` over the cluster's intra- or inter-node link."""
    bw = (cluster.intra_bandwidth if intra else cluster.inter_bandwidth) * cluster.efficiency.link
    alpha = cluster.intra_latency if intra else cluster.inter_latency
    return ring_seconds(kind, n, nbytes, calls, alpha, bw)


def _blocks_rerun(ac_mode: str) -> float:
    """The share of blocks whose whole forward (its TP collectives too) runs again in backward."""
    if ac_mode == "full":
        return 1.0
    tail = ac_mode.split("_", 1)[-1]
    return 1 / int(tail) if ac_mode.startswith("selective_") and tail.isdigit() else 0.0


def fsdp_calls(lay: Layout, run: Any, work: Any) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) FSDP2 runs over dp_shard in one step of one rank, as the
    trainer and torch issue them, one per unit (each block, the embedding, the norm + output):
    - without PP, per accumulation microbatch (`titanlab.trainer.step`'s `_set_microbatch_sync`):
      ZeRO 3 gathers before the forward and again before the backward when it reshards after
      forward (`parallelize.reshard_policy`; never the norm + output), and reduce-scatters;
      ZeRO 2 gathers once per step and reduce-scatters per microbatch; ZeRO 1 once each;
    - with PP, torch's schedules keep the gradients unreduced and the parameters gathered over
      a step's pipeline microbatches (`set_requires_gradient_sync`, `set_reshard_after_backward`)
      and reduce-scatter once; a unit resharded after forward (ZeRO 3 with
      `fsdp_reshard_after_forward = "always"`; the default does not under PP) gathers again for
      each microbatch's forward and backward."""
    from titanlab.distributed.parallelize import reshard_policy

    units, micro = work.units, work.microbatches
    reshard = reshard_policy(run.fsdp_reshard_after_forward, lay.pp > 1, lay.zero_stage)
    if lay.zero_stage == 0:
        return 0, 0
    if lay.pp > 1:
        gathers = (2 * units - work.has_head) * micro if reshard else units * lay.grad_accum
        return gathers, units * lay.grad_accum
    if lay.zero_stage == 3:
        return (2 * units - work.has_head if reshard else units) * micro, units * micro
    return units, units * (micro if lay.zero_stage == 2 else 1)


def _communication(shape: Any, run: Any, lay: Layout, cluster: Cluster, work: Any) -> list[Comm]:
    """Every collective of one step of one rank (see the module docstring): `shape` a
    `perf_model.ModelShape`, `run` a `perf_model.Run`, `work` its per-rank step quantities
    (typed loosely: perf_model imports this module)."""
    out: list[Comm] = []
    e, g = run.param_bytes, run.grad_bytes
    micro = work.microbatches
    dense = shape.total_params - shape.expert_params
    # one stage's weights on one rank before FSDP: dense ones split by tp, experts by ep
    stage_params = (dense / lay.tp + shape.expert_params / lay.ep) / lay.pp
    fsdp = lay.dp_shard * lay.cp
    # FSDP2 (and its `replicate`, titanlab's DDP) runs one collective per unit: each block, the
    # embedding and the norm + output; each pays the link's latency.
    units = work.units
    if fsdp > 1:
        dims = ("dp_shard", "cp") if lay.cp > 1 else ("dp_shard",)
        intra = intra_node(lay, dims, cluster)
        gathers, reduces = fsdp_calls(lay, run, work)
        name = "+".join(dims)
        for kind, calls, nbytes in (("all-gather", gathers, stage_params * e / units),
                                    ("reduce-scatter", reduces, stage_params * g / units)):  # fmt: skip
            if calls and lay.zero_stage > 0:
                t = _ring(kind, fsdp, nbytes, calls, intra, cluster)
                out.append(Comm(kind, name, fsdp, calls * nbytes, t, calls, intra_node=intra))
    replicas = lay.dp_replicate * (fsdp if lay.zero_stage == 0 else 1)  # stage 0: DDP
    if replicas > 1:
        dims = ("dp_replicate", "dp_shard") if lay.zero_stage == 0 else ("dp_replicate",)
        intra = intra_node(lay, dims, cluster)
        # DDP's `replicate` reduces each block and then the root (embedding, norm and output
        # together); HSDP each FSDP unit's shard
        calls = work.blocks + 1 if lay.zero_stage == 0 or fsdp == 1 else units
        nbytes = stage_params / (fsdp if lay.zero_stage else 1) * g / calls
        t = _ring("all-reduce", replicas, nbytes, calls, intra, cluster)
        out.append(Comm("all-reduce", "dp_replicate", replicas, calls * nbytes, t, calls,
                        intra_node=intra))  # fmt: skip
    tokens_mb = work.samples_per_microbatch * run.seq_len // lay.cp
    recomputed = _blocks_rerun(run.ac_mode)
    if lay.tp > 1:  # Megatron + SP: 2 all-gathers and 2 reduce-scatters forward, as many back,
        intra = intra_node(lay, ("tp",), cluster)  # and the forward's again where recomputed
        nbytes = tokens_mb * shape.dim * e
        calls = round((4 + 2 * recomputed) * work.blocks * micro)
        for kind in ("all-gather", "reduce-scatter"):
            t = _ring(kind, lay.tp, nbytes, calls, intra, cluster)
            out.append(Comm(kind, "tp", lay.tp, calls * nbytes, t, calls, intra_node=intra))
    if lay.cp > 1 and lay.cp_rotate == "ulysses":  # q, k, v and the output through an
        intra = intra_node(lay, ("cp",), cluster)  # all-to-all forward, their gradients back
        nbytes = tokens_mb * shape.n_heads * shape.head_dim // lay.tp * e
        calls = round((8 + 4 * recomputed) * work.blocks * micro)
        t = _ring("all-to-all", lay.cp, nbytes, calls, intra, cluster)
        out.append(Comm("all-to-all", "cp", lay.cp, calls * nbytes, t, calls, intra_node=intra))
    elif lay.cp > 1:  # K and V gathered forward, their gradients reduce-scattered backward
        intra = intra_node(lay, ("cp",), cluster)
        kv = 2 * tokens_mb * lay.cp * shape.kv_heads * shape.head_dim // lay.tp * e
        calls = work.blocks * micro
        for kind in ("all-gather", "reduce-scatter"):
            t = _ring(kind, lay.cp, kv, calls, intra, cluster)
            out.append(Comm(kind, "cp", lay.cp, calls * kv, t, calls, intra_node=intra))
    if lay.ep > 1 and shape.moe_layers:  # dispatch and combine, forward and backward
        intra = _on_one_node(lay.ep, cluster)  # ep ranks: the innermost of dp_shard × cp × tp
        nbytes = tokens_mb // lay.tp * shape.top_k * shape.dim * e
        moe_blocks = math.ceil(work.blocks * shape.moe_layers / shape.n_layers)
        calls = 4 * moe_blocks * micro
        t = _ring("all-to-all", lay.ep, nbytes, calls, intra, cluster)
        out.append(Comm("all-to-all", "ep", lay.ep, calls * nbytes, t, calls, intra_node=intra))
    groups = [d for d, n in (("dp_shard", lay.dp_shard), ("cp", lay.cp), ("tp", lay.tp)) if n > 1]
    if run.optimizer == "Muon" and lay.zero_stage == 0:
        groups = [d for d in groups if d == "tp"]  # DDP: whole matrices on every rank
    n = math.prod(_degrees(lay)[d] for d in groups)
    if run.optimizer == "Muon" and n > 1:
        # Newton-Schulz's two all-to-alls: each matrix to its owner and its shards back, a rank
        # sending 2·P·(n−1)/n² of the stage's P matrix elements (titanlab.components.muon_sharded)
        dense = shape.muon_params - shape.muon_expert_params
        stage = (dense + shape.muon_expert_params / lay.ep) / lay.pp
        nbytes = stage * g / n  # per call, as an all-gather of it: (n−1)/n of it leaves
        intra = intra_node(lay, tuple(groups), cluster)
        t = _ring("all-to-all", n, nbytes, 2, intra, cluster)
        out.append(Comm("all-to-all", "+".join(groups) + " (muon)", n, 2 * nbytes, t, 2,
                        intra_node=intra))  # fmt: skip
    if lay.pp > 1:  # each microbatch's activations forward and their gradient backward
        intra = intra_node(lay, ("pp",), cluster)
        nbytes = tokens_mb * shape.dim * shape.boundary_width // lay.tp * e
        calls = 2 * micro * work.per_rank
        t = _ring("send", 2, nbytes, calls, intra, cluster)
        out.append(Comm("send", "pp", lay.pp, calls * nbytes, t, calls, intra_node=intra))
    return out
