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
- **Host syncs** (`.item()`, `.cpu()`, expert parallel's split sizes) stall the GPU for
  `host_sync_s` plus the copy at `host_copy_bandwidth`, serially (assumptions, stated there).
- **Collectives** on the profile's links in the α–β ring model (`comm_model.ring_seconds`): a
  group of at most `devices_per_node` ranks on NVLink, a larger one on the NICs. FSDP's and
  DDP's (c10d's in-place all-gathers, reduce-scatters and all-reduces on the dp_shard,
  dp_replicate and efsdp groups, in forward and backward) overlap the compute, under the
  assumptions `Overlap` states (the first and last are exposed, what exceeds the phase's
  compute is exposed, the compute beside them is slowed). A functional collective (DTensor's,
  expert parallel's all-to-alls) runs beside the ops recorded between it and its
  `wait_tensor` (`waits`), on its group's stream after the group's earlier collectives; only
  what outlasts them is exposed (`async_exposure`). The rest (c10d's blocking collectives: the
  token counts' all-to-all, the gradient norm's and the loss's reductions) wait.

Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titanlab.ledger.record import OpRecord, fsdp_copy
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
    """Achieved ÷ peak bf16 FLOP/s of cuDNN's flash attention (SDPA's pick on compute
    capability 9.0+), on the FLOPs of the tiles it computes
    (`titanlab.ledger.record.causal_fraction`): fitted on the bf16 row's cuDNN attention
    (42 ms; fitted 0.518)."""
    attention_flash: float = 0.27
    """The same for FlashAttention-2 (SDPA's flash backend): fitted on the FA2 row (cuDNN's
    SDPA off: 80 ms of attention for the FLOPs cuDNN ran in 42; fitted 0.272). The
    memory-efficient kernel (a mask; MLA's 192/128 head dims) and FlexAttention (documents,
    windows, sinks) are priced at it too, unmeasured: FlexAttention's authors report 85–90% of
    FlashAttention-2's speed (PyTorch blog, "FlexAttention", 2024-08), so these may read up to
    ~15% fast."""
    float8_tensorwise: float = 0.47
    """Achieved ÷ peak float8 FLOP/s of a tensorwise-scaled `_scaled_mm`: fitted on the float8
    tensorwise row's GEMMs (162 ms, of which the bf16 head's are priced at `matmul`; fitted
    0.465)."""
    float8_rowwise: float = 0.38
    """The same for rowwise scaling (torch 2.11's rowwise `_scaled_mm` is no faster than bf16
    there): fitted on the float8 rowwise row's GEMMs (190 ms, its only row; fitted 0.382)."""
    launch_s: float = 4e-6
    """Seconds a kernel takes however small (launch and tail)."""
    host_sync_s: float = 20e-6
    """Seconds a host sync stalls the GPU (an assumption, not fitted: no profiled row has
    one): the host waits for the queue to drain, reads, and launches again, so the GPU idles
    for that round trip, ~10 µs, and the next kernel's launch, ~10 µs (the CUDA C++ Best
    Practices Guide, "Asynchronous and overlapping transfers with computation": a blocking
    transfer or synchronization serializes host and device)."""
    host_copy_bandwidth: float = 25e9
    """Bytes/s of a device-to-host copy into pageable host memory (`.cpu()`), an assumption: a
    fraction of PCIe 5.0 x16's 64 GB/s, as pageable copies are staged through a pinned buffer."""

    def gemm(self, op: OpRecord, device: Cluster) -> float:
        """Achieved ÷ peak FLOP/s of `op`'s GEMM or attention kernel on `device`."""
        if op.kind == "attention":
            return self.attention if "cudnn" in op.op else self.attention_flash
        if op.dtype.startswith("float8"):
            return self.float8_rowwise if op.rowwise else self.float8_tensorwise
        return device.efficiency.matmul


def dtype_key(dtype: str) -> str:
    """The cluster profile's peak that prices a GEMM in `dtype` (a torch dtype name)."""
    if dtype.startswith("float8"):
        return "float8"
    return {"bfloat16": "bfloat16", "float16": "float16"}.get(dtype, "float32")


def _fuses(op: OpRecord) -> bool:
    """Whether Inductor fuses `op` into its compiled region's kernels: every op there but extern
    kernels (GEMMs, attention, collectives, `titanlab::` stand-ins), syncs and `fsdp_copy`."""
    fusible = op.region is not None and op.kind in ("pointwise", "other")
    return fusible and not fsdp_copy(op.op, op.phase) and not op.op.startswith("titanlab.")


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


@dataclass(frozen=True)
class Overlap:
    """How FSDP's and DDP's collectives share the GPU with the compute beside them: the
    assumptions of `price`'s central estimate (not fitted: no multi-GPU step has been
    profiled yet, docs/ledger.md "Limits"). Its range runs from perfect overlap (every such
    collective hidden, for free) to serialized (every collective waited for).

    - A collective issued in forward before the phase's first GEMM (the first unit's
      all-gather) or in backward after its last (the last units' reduce-scatters) has no
      compute to hide behind: exposed, as the planner's `perf_model` prices them.
    - The others run beside the phase's compute; what exceeds it is exposed.
    - While a collective runs beside a GEMM, NCCL's kernels hold some of the SMs (one per
      channel: 16 to 32 of an H100's 132 for an 8-GPU ring) and share HBM bandwidth with it,
      so the compute is slowed by `contention` × the seconds it overlaps."""

    contention: float = 0.15
    """Seconds the compute beside a collective loses per second of overlap (an assumption:
    the SM share NCCL's channels hold, ~12–25%, plus the HBM traffic of its copies)."""


OVERLAP_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
"""Collectives FSDP2 and DDP issue on their own streams (c10d's in-place ops), which run beside
the compute on an `OVERLAPPED` dim under `Overlap`'s assumptions; an all-to-all (expert
parallel's dispatch and combine, on whichever group it runs, the dp_shard group included) runs
beside only the ops before its wait (`async_exposure`)."""


def overlaps(op: OpRecord, dim: str) -> bool:
    """Whether collective `op`, on mesh dim `dim`, runs beside the compute: FSDP's all-gathers
    and reduce-scatters and DDP's all-reduce (c10d's in-place ops, `_allgather_base_` & co.)
    issued in forward or backward on a data-parallel dim. The others (functional collectives:
    tensor parallel's, expert parallel's all-to-alls; c10d's blocking ones; every collective of
    the gradient norm, the optimizer and the step) are priced by `async_exposure`."""
    return (
        dim in OVERLAPPED
        and op.collective in OVERLAP_KINDS
        and op.op.startswith("c10d.")
        and op.phase in ("forward", "backward")
    )


def waits(ops: list[OpRecord]) -> dict[int, int]:
    """Index of each functional collective (`_c10d_functional.*`) → index of the op where the
    compute stream waits for it: its `wait_tensor`, or for a `deferred` one the first op that
    is not a view and reads the result or a view of it (an `AsyncCollectiveTensor`'s first
    use). A collective never waited for is absent."""
    issued: dict[int, int] = {}  # a result's tensor id → its collective's index
    pending: dict[int, int] = {}  # the tensor ids of a deferred wait's result and its views
    found: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.kind == "collective" and op.op.startswith("_c10d_functional."):
            issued.update({t: i for t in op.outputs})
        elif op.op.startswith("_c10d_functional.wait_tensor") and op.inputs:
            source = issued.pop(op.inputs[0], None)
            if source is not None and op.deferred:
                pending.update({t: source for t in op.outputs})
            elif source is not None:
                found.setdefault(source, i)
        elif op.kind == "view":
            source = next((pending[t] for t in op.inputs if t in pending), None)
            if source is not None:
                pending.update({t: source for t in op.outputs})
        else:
            for t in op.inputs:
                if t in pending:
                    found.setdefault(pending[t], i)
    return found


def in_graph_schedule(ops: list[OpRecord]) -> tuple[list[int], list[OpRecord]]:
    """(order, the ops in it): the order a compiled block runs `ops` in when Inductor overlaps
    its functional
    collectives (`titanlab.distributed.compile.overlap_in_graph_collectives`: `raise_comms`
    and `sink_waits`): each `_c10d_functional.*` collective of forward and backward issued
    right after the last op producing one of its inputs, and each wait moved to the first
    use of its result (marked `deferred`, as eager's `AsyncCollectiveTensor` waits are)."""
    produced: dict[int, int] = {}  # tensor id → index of the op writing it
    keys: list[tuple[int, int, int]] = []
    region, start = ("", ""), 0
    for i, op in enumerate(ops):
        # a graph's ops: one phase of one block (Inductor reorders within a graph only)
        here = (op.phase, ".".join(op.module.split(".")[:2]))
        region, start = (region, start) if here == region else (here, i)
        in_graph = op.phase in ("forward", "backward") and op.op.startswith("_c10d_functional.")
        if in_graph and op.kind == "collective":
            ready = max((produced.get(t, -1) for t in op.inputs), default=-1)
            keys.append((max(ready, start - 1), 1, i))
        else:
            keys.append((i, 0, i))
        produced.update({t: i for t in op.outputs})
    order = sorted(range(len(ops)), key=keys.__getitem__)
    in_graph_wait = ("forward", "backward")
    return order, [
        replace(ops[i], deferred=True)
        if ops[i].op.startswith("_c10d_functional.wait_tensor") and ops[i].phase in in_graph_wait
        else ops[i]
        for i in order
    ]


def async_exposure(
    ops: list[OpRecord], seconds: list[float], waited: list[int]
) -> tuple[float, float]:
    """(exposed, hidden) seconds of the collectives at indices `waited` (those that do not run
    beside the compute as FSDP's do), on a timeline: the compute stream runs every
    non-collective op in order; each process group's collectives run one after another on its
    own stream, a collective starting when it is issued and its group's previous one is done.
    One with a `wait_tensor` (`waits`) makes the compute stream wait there for its end; one
    without (c10d's blocking ops) at once. The exposed seconds are the compute stream's waits."""
    wait_of = waits(ops)
    chosen = set(waited)
    clock = exposed = hidden = 0.0
    stream_free: dict[str, float] = {}
    due: dict[int, list[tuple[float, float]]] = {}  # wait index → (end, seconds) of its collective
    for i, (op, s) in enumerate(zip(ops, seconds)):
        for end, length in due.pop(i, ()):
            stall = max(0.0, end - clock)
            exposed, hidden, clock = (
                exposed + stall,
                hidden + length - min(stall, length),
                clock + stall,
            )
        if op.kind == "collective":
            if i not in chosen:
                continue
            start = max(clock, stream_free.get(op.group, 0.0))
            stream_free[op.group] = end = start + s
            if i in wait_of:
                due.setdefault(wait_of[i], []).append((end, s))
            else:
                exposed, clock = exposed + end - clock, end
        else:
            clock += s
    return exposed, hidden


@dataclass
class Priced:
    """A recorded step's prices: `seconds[i]` of `ops[i]` (a collective's own transfer time),
    the step's compute, communication and exposed time, and the range the overlap's
    assumptions span (`Overlap`)."""

    ops: list[OpRecord]
    seconds: list[float]
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    contention_s: float = 0.0
    """Seconds the compute loses to the collectives running beside it (`Overlap.contention`)."""
    perfect_s: float = 0.0
    """The step if every overlapping collective were hidden for free (the ledger's figure
    before 2026-12-02)."""
    serialized_s: float = 0.0
    """The step if every collective were waited for."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.contention_s + self.exposed_comm_s


def collective_seconds(op: OpRecord, device: Cluster) -> float:
    """One collective's α–β seconds on the link its group uses."""
    intra = op.group_size <= device.devices_per_node
    alpha = device.intra_latency if intra else device.inter_latency
    beta = (device.intra_bandwidth if intra else device.inter_bandwidth) * device.efficiency.link
    kind = _RING_KIND.get(op.collective, "all-gather")
    return ring_seconds(kind, op.group_size, op.bytes_read, 1, alpha, beta)


def op_seconds(
    ops: list[OpRecord], device: Cluster, efficiency: LedgerEfficiency = LedgerEfficiency()
) -> list[float]:
    """Each op's own seconds on `device`: a kernel's roofline time, a collective's transfer,
    a host sync's stall (the module docstring's rules)."""
    bandwidth = device.memory_bandwidth * efficiency.memory
    fused_bandwidth = device.memory_bandwidth * efficiency.fused
    seconds = []
    for op, (read, written) in zip(ops, fused_traffic(ops)):
        if op.kind == "view":
            s = 0.0
        elif op.kind == "sync":  # the GPU idles while the host waits, reads and relaunches
            s = efficiency.host_sync_s + op.bytes_read / efficiency.host_copy_bandwidth
        elif op.kind == "collective":
            s = collective_seconds(op, device)
        else:
            fused_away = _fuses(op)
            s = (read + written) / (fused_bandwidth if fused_away else bandwidth)
            if op.flops:
                peak = device.flops(dtype_key(op.dtype))
                s = max(s, op.flops / (peak * efficiency.gemm(op, device)))
            s += 0.0 if fused_away else efficiency.launch_s
        seconds.append(s)
    return seconds


def price(
    ops: list[OpRecord],
    device: Cluster,
    group_dims: dict[str, str] | None = None,
    efficiency: LedgerEfficiency = LedgerEfficiency(),
    overlap: Overlap = Overlap(),
    in_graph_overlap: bool = False,
) -> Priced:
    """Price `ops` on `device`. `group_dims`: process-group name → mesh dim name (which
    collectives may overlap the compute, `overlaps`); unnamed groups wait.
    `in_graph_overlap`: the ops run in the order compiled blocks overlapping their
    collectives give (`in_graph_schedule`)."""
    group_dims = group_dims or {}
    priced_ops = ops
    seconds = priced_seconds = op_seconds(ops, device, efficiency)
    if in_graph_overlap:  # the timeline below in the compiled blocks' order
        order, ops = in_graph_schedule(ops)
        seconds = [seconds[i] for i in order]
    compute = sum(s for op, s in zip(ops, seconds) if op.kind != "collective")
    exposed = hidden = 0.0
    by_phase: dict[str, list[tuple[int, float]]] = {}
    waited: list[int] = []
    for i, (op, s) in enumerate(zip(ops, seconds)):
        if op.kind != "collective":
            continue
        if overlaps(op, group_dims.get(op.group, "")):
            by_phase.setdefault(op.phase, []).append((i, s))
        else:
            waited.append(i)
    waited_s = sum(seconds[i] for i in waited)
    waited_exposed, waited_hidden = async_exposure(ops, seconds, waited)
    overlapped = sum(s for found in by_phase.values() for _, s in found)
    for phase, found in by_phase.items():
        gemms = [i for i, op in enumerate(ops)
                 if op.phase == phase and op.kind in ("gemm", "attention")]  # fmt: skip
        first, last = (gemms[0], gemms[-1]) if gemms else (len(ops), -1)
        ends = sum(s for i, s in found if (i < first if phase == "forward" else i > last))
        window = sum(s for op, s in zip(ops, seconds) if op.phase == phase and
                     op.kind not in ("collective", "sync"))  # fmt: skip
        beside = sum(s for _, s in found) - ends
        exposed += ends + max(0.0, beside - window)
        hidden += min(beside, window)
    perfect = compute + waited_exposed + max(0.0, overlapped - compute)
    return Priced(priced_ops, priced_seconds, compute, overlapped + waited_s,
                  waited_exposed + exposed,
                  overlap.contention * (hidden + waited_hidden), perfect,
                  compute + overlapped + waited_s)  # fmt: skip
