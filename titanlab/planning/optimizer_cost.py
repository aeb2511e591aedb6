"""The optimizer's share of the predicted step (`titanlab.planning.perf_model`): AdamW's and
Muon's memory traffic, and Muon's Newton–Schulz FLOPs."""

from __future__ import annotations

from typing import Any

from titanlab.planning.cluster import Cluster


def optimizer_seconds(shape: Any, run: Any, shard: int, cluster: Cluster) -> float:
    """The update's memory traffic over `shard` ranks: AdamW reads and writes ~28 bytes per
    parameter (fp32 weight, gradient, two moments), Muon's matrices ~20 (one momentum buffer);
    plus Muon's Newton–Schulz FLOPs (ns_steps iterations of `ModelShape.muon_ns_flops`), which
    the owner-balanced orthogonalization splits over the same ranks (HSDP's replicas each
    compute them: `titanlab.components.muon_sharded`), at the matmul peak of its dtype."""
    eff = cluster.efficiency
    muon = shape.muon_params if run.optimizer == "Muon" else 0
    nbytes = 28 * (shape.total_params - muon) + 20 * muon
    seconds = nbytes / shard / (cluster.memory_bandwidth * eff.optimizer)
    if muon:
        flops = shape.muon_ns_flops * run.muon_ns_steps
        peak = cluster.peak_flops.get(run.muon_ns_dtype) or max(cluster.peak_flops.values())
        seconds += flops / shard / (peak * eff.matmul)
    return seconds
