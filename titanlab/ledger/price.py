"""Pricing a recorded step on a device profile's roofline: seconds per op, per collective, and
the step's.

- **An op** takes max(FLOPs ÷ (peak FLOP/s of its dtype × efficiency), bytes ÷ (HBM bandwidth ×
  efficiency)) plus a kernel-launch floor (Williams, Waterman and Patterson, "Roofline", CACM
  2009); the efficiencies are `LedgerEfficiency`'s, fitted on profiled GPU steps. The peaks
  are the cluster profile's (`titanlab.planning.cluster`, one source of truth with the
  planner); fp32 GEMMs are priced at the fp32 rate, since titanlab never enables TF32.
- **Compiled regions** (a module compiled with `nn.Module.compile`, `Recorder`'s regions) fuse
  what Inductor generates code for (pointwise ops, casts, reductions, copies: every op but the
  extern kernels), as Inductor does: inside one region and phase, such an op reads from memory
  only the inputs no fused op of the region made (each once for the region), writes only the
  outputs something else reads (an op outside the region, a GEMM, the backward), and pays no
  launch of its own. GEMMs, attention and collectives stay their own kernels.
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
    """Fractions of the peaks kernels reach, and the launch floor. bf16 and fp32 GEMMs run at
    the cluster profile's `Efficiency.matmul` (measured: the H100's profiled GEMMs at 0.77 of
    peak). The others are fitted by `tools/ledger_calibration.py --fit` on the profiled H100
    rows of 2026-11-23 (docs/performance.md, "The ledger against the GPU rows") and checked on
    the rows not used to fit."""

    memory: float = 0.78
    """Achieved ÷ peak HBM bandwidth of a memory-bound kernel outside compiled regions: fitted
    on the bf16 row's fused AdamW and gradient-norm kernels (53 ms; fitted 0.777)."""
    fused: float = 1.06
    """Peak-bandwidth seconds of the traffic `fused_traffic` counts ÷ the measured seconds of a
    compiled region's fused kernels: fitted on the bf16 row's Triton kernels (32 ms; fitted
    1.062). Above 1 because the count is an upper bound: Inductor's partitioner recomputes
    cheap pointwise ops in backward rather than reading what forward saved, and a kernel reads
    an input once for several ops; this factor scales the count to the measured time."""
    attention: float = 0.52
    """Achieved ÷ peak bf16 FLOP/s of flash attention, on the FLOPs of the tiles it computes
    (`titanlab.ledger.record.causal_fraction`): fitted on the bf16 row's cuDNN attention
    (42 ms; fitted 0.518)."""
    float8_tensorwise: float = 0.47
    """Achieved ÷ peak float8 FLOP/s of a tensorwise-scaled `_scaled_mm`: fitted on the float8
    tensorwise row's GEMMs (162 ms, of which the bf16 head's are priced at `matmul`; fitted
    0.465)."""
    float8_rowwise: float = 0.38
    """The same for rowwise scaling (torch 2.11's rowwise `_scaled_mm` is no faster than bf16
    there): fitted on the float8 rowwise row's GEMMs (190 ms, its only row; fitted 0.382)."""
    launch_s: float = 4e-6
    """Seconds a kernel takes however small (launch and tail)."""

    def gemm(self, op: OpRecord, device: Cluster) -> float:
        """Achieved ÷ peak FLOP/s of `op`'s GEMM or attention kernel on `device`."""
        if op.kind == "attention":
            return self.attention
        if op.dtype.startswith("float8"):
            return self.float8_rowwise if op.rowwise else self.float8_tensorwise
        return device.efficiency.matmul


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
    counted: set[tuple[int | None, str, int]] = set()  # (region, phase, tensor) already read
    for op in ops:
        if not _fuses(op):
            out.append((op.bytes_read, op.bytes_written))
            continue
        home = (op.region, op.phase, True)
        per_in = op.bytes_read // max(len(op.inputs), 1)
        per_out = op.bytes_written // max(len(op.outputs), 1)
        read = 0
        for t in op.inputs:  # a tensor from outside, read once by the region's fused kernels
            base = alias.get(t, t)
            if made_by.get(base) != home and (op.region, op.phase, base) not in counted:
                counted.add((op.region, op.phase, base))
                read += per_in
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
    bandwidth = device.memory_bandwidth * efficiency.memory
    fused_bandwidth = device.memory_bandwidth * efficiency.fused
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
        fused_away = _fuses(op)
        s = (read + written) / (fused_bandwidth if fused_away else bandwidth)
        if op.flops:
            peak = device.flops(dtype_key(op.dtype))
            s = max(s, op.flops / (peak * efficiency.gemm(op, device)))
        s += 0.0 if fused_away else efficiency.launch_s
        seconds.append(s)
        compute += s
    exposed = waited + max(0.0, overlapped - compute)
    return Priced(ops, seconds, compute, overlapped + waited, exposed)
