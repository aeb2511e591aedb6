"""Pricing a recorded step on a device profile's roofline: seconds per op, per collective, and
the step's.

- **An op** takes max(FLOPs ÷ (peak FLOP/s of its dtype × efficiency), bytes ÷ (HBM bandwidth ×
  efficiency; the optimizer's at the profile's `Efficiency.optimizer`)) plus a kernel-launch floor (Williams, Waterman and Patterson, "Roofline", CACM
  2009). The peaks are the cluster profile's (`titanlab.planning.cluster`, one source of truth
  with the planner); fp32 GEMMs are priced at the fp32 rate, since titanlab never enables TF32.
- **Compiled regions** (a module compiled with `nn.Module.compile`, `Recorder`'s regions) fuse
  what Inductor generates code for (pointwise ops, casts, reductions, copies: every op but the
  extern kernels), as Inductor does: inside one region and phase, such an op reads from memory
  only the inputs no fused op of the region made, writes only the outputs something else reads
  (an op outside the region, a GEMM, the backward), and pays no launch of its own. GEMMs,
  attention and collectives stay their own kernels.
- **Collectives** on the profile's links in the α–β ring model (`comm_model.ring_seconds`): a
  group of at most `devices_per_node` ranks on NVLink, a larger one on the NICs. FSDP's and
  DDP's (the dp_shard, dp_replicate and efsdp groups) overlap the compute and only what exceeds
  it is exposed; the others (TP, CP, EP) wait.

Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlab.ledger.record import OpRecord
from titanlab.planning.cluster import Cluster
from titanlab.planning.comm_model import ring_seconds

OVERLAPPED = ("dp_shard", "dp_replicate", "efsdp", "dp_shard_cp", "dp")
"""Mesh dims whose collectives (FSDP2's all-gathers and reduce-scatters, DDP's all-reduce) run
beside the compute."""
_RING_KIND = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
              "all_reduce": "all-reduce", "all_to_all": "all-to-all", "broadcast": "all-gather"}  # fmt: skip


@dataclass(frozen=True)
class LedgerEfficiency:
    """Fractions of the peaks kernels reach, and the launch floor. GEMM and attention
    efficiencies are the cluster profile's (`Efficiency.matmul`, `.attention`)."""

    memory: float = 0.7
    """Achieved ÷ peak HBM bandwidth of a memory-bound kernel."""
    launch_s: float = 4e-6
    """Seconds a kernel takes however small (launch and tail)."""


def dtype_key(dtype: str) -> str:
    """The cluster profile's peak that prices a GEMM in `dtype` (a torch dtype name)."""
    if dtype.startswith("float8"):
        return "float8"
    return {"bfloat16": "bfloat16", "float16": "float16"}.get(dtype, "float32")


def _fuses(op: OpRecord) -> bool:
    """Whether Inductor generates `op` into the fused kernels of its compiled region: every op
    there but the extern kernels (GEMMs, attention, collectives) and host syncs."""
    return op.region is not None and op.kind in ("pointwise", "other")


def fused_traffic(ops: list[OpRecord]) -> list[tuple[int, int]]:
    """(bytes read, bytes written) of each op of `ops` once compiled regions fuse their
    pointwise ops (the module docstring's rule); other ops keep their own."""
    alias: dict[int, int] = {}
    for op in ops:  # a view's output is its input's memory
        if op.kind == "view" and op.inputs:
            base = alias.get(op.inputs[0], op.inputs[0])
            alias.update({o: base for o in op.outputs})
    made_by: dict[int, tuple[int | None, str, bool]] = {}
    readers: dict[int, list[tuple[int | None, str, bool]]] = {}
    for op in ops:
        fused = _fuses(op)
        where = (op.region, op.phase, fused)
        for t in op.outputs:
            made_by.setdefault(alias.get(t, t), where)
        if op.kind != "view":
            for t in op.inputs:
                readers.setdefault(alias.get(t, t), []).append(where)
    out = []
    for op in ops:
        if not _fuses(op):
            out.append((op.bytes_read, op.bytes_written))
            continue
        home = (op.region, op.phase, True)
        per_in = op.bytes_read // max(len(op.inputs), 1)
        per_out = op.bytes_written // max(len(op.outputs), 1)
        read = sum(per_in for t in op.inputs if made_by.get(alias.get(t, t)) != home)
        written = sum(
            per_out
            for t in op.outputs
            if any(r != home for r in readers.get(alias.get(t, t), [])) or t not in readers
        )
        out.append((read, written))
    return out


@dataclass
class Priced:
    """A recorded step's prices: `seconds[i]` of `ops[i]` (a collective's own transfer time),
    and the step's compute, communication and exposed time."""

    ops: list[OpRecord]
    seconds: list[float]
    compute_s: float
    comm_s: float
    exposed_comm_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s


def collective_seconds(op: OpRecord, device: Cluster) -> float:
    """One collective's α–β seconds on the link its group uses."""
    intra = op.group_size <= device.devices_per_node
    alpha = device.intra_latency if intra else device.inter_latency
    beta = (device.intra_bandwidth if intra else device.inter_bandwidth) * device.efficiency.link
    kind = _RING_KIND.get(op.collective, "all-gather")
    return ring_seconds(kind, op.group_size, op.bytes_read, 1, alpha, beta)


def price(
    ops: list[OpRecord],
    device: Cluster,
    group_dims: dict[str, str] | None = None,
    efficiency: LedgerEfficiency = LedgerEfficiency(),
) -> Priced:
    """Price `ops` on `device`. `group_dims`: process-group name → mesh dim name (which
    collectives overlap the compute); unnamed groups wait."""
    group_dims = group_dims or {}
    eff = device.efficiency
    bandwidth = device.memory_bandwidth * efficiency.memory
    optimizer_bandwidth = device.memory_bandwidth * eff.optimizer
    seconds, compute, overlapped, waited = [], 0.0, 0.0, 0.0
    for op, (read, written) in zip(ops, fused_traffic(ops)):
        if op.kind == "view":
            seconds.append(0.0)
            continue
        if op.kind == "collective":
            s = collective_seconds(op, device)
            seconds.append(s)
            if group_dims.get(op.group, "") in OVERLAPPED:
                overlapped += s
            else:
                waited += s
            continue
        # the optimizer's kernels at the bandwidth the profile measured for them
        s = (read + written) / (optimizer_bandwidth if op.phase == "optimizer" else bandwidth)
        if op.flops:
            rate = eff.attention if op.kind == "attention" else eff.matmul
            s = max(s, op.flops / (device.flops(dtype_key(op.dtype)) * rate))
        fused_away = _fuses(op)
        s += 0.0 if fused_away else efficiency.launch_s
        seconds.append(s)
        compute += s
    exposed = waited + max(0.0, overlapped - compute)
    return Priced(ops, seconds, compute, overlapped + waited, exposed)
