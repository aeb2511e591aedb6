"""Predicted step time of a parallel layout on a cluster: compute, pipeline bubble, optimizer,
the communication left exposed, and the measured overheads of a split backward and of tensor
parallel (docs/planning.md writes the model out with its sources).

- Compute on a GPU profile, where `titanlab.plan` has the per-op ledger price it
  (`compute_costs.ComputeCosts`): one sequence through a block, the head and the embedding and
  the update per parameter as `titanlab ledger` prices them on the target GPU's code path,
  scaled to the layout (sequences per rank, blocks of its busiest pipeline rank, ÷ tp × cp;
  parameters per rank), FSDP2's buffer copies per byte its collectives move (in the FSDP
  overhead). Otherwise (and on CPU profiles, whose efficiencies are measured):
- Compute: the trainer's training FLOPs per token (`flops_per_token`: 6 × the active
  non-embedding parameters, an MoE layer's experts at top_k / num_experts, + 12·L·H·Q·s of
  attention; Kaplan et al. 2020, PaLM Appendix B), plus the recomputation of the AC mode, each
  kernel class on its own: full AC runs the blocks' forward again (their matmuls' 2 FLOPs per
  weight and attention's 4·H·Q·s), every k-th block 1/k of that, op-level selective AC every
  other matmul of a block's forward (attention's output is saved). The work of the busiest
  pipeline rank (its stages' blocks by `layers_per_stage`, the output head on the last stage)
  splits evenly over tp × cp × dp; time = FLOPs ÷ (peak × the kernel class's efficiency),
  pointwise work a share of the GEMM time. float8 runs the Linear layers at the float8 peak and
  attention at the bf16 one.
- Pipeline bubble, as a fraction of a stage's compute (not of the step), for p stages, m
  microbatches and v stages per rank: GPipe and 1F1B (p−1)/m (Huang et al. 2019; Narayanan et
  al. 2021), interleaved (Interleaved1F1B, LoopedBFS) (p−1)/(v·m) (Narayanan et al. 2021
  §2.2), zero-bubble schedules a third of their base's (ZB-H1, Qi et al. 2023, "Zero Bubble
  Pipeline Parallelism"; ZBV and DualPipeV at v = 2: (p−1)/(6m)).
- Communication: per mesh dimension, a ring (NCCL's bandwidth-optimal algorithm): all-gather
  and reduce-scatter of M bytes over n ranks (n−1)·α + (n−1)/n · M / β, all-reduce twice that,
  all-to-all as one all-gather, a point-to-point send α + M / β (the α–β model, Hockney 1994;
  Thakur et al. 2005). β is the intra-node link when every group of the dimension lies on one
  node (mesh order pp, dp_replicate, dp_shard, cp, tp, outermost first, as `ParallelDims`
  builds it), else the inter-node one.
- Overlap: the data-parallel collectives (FSDP's all-gathers and reduce-scatters, DDP's and
  HSDP's all-reduce) share one link and run behind the step's compute, together: what exceeds
  the compute is exposed, and so are the first unit's all-gather and the last unit's reduction
  (nothing is left to hide them). TP's, CP's and EP's collectives are on the critical path; of
  the pipeline's sends only the fill and drain are. On CPU FSDP2 waits for every collective
  where it issues it (no prefetch, no side stream): the data-parallel ones are exposed whole.
- FSDP2 (and its `replicate`, titanlab's DDP) runs one collective per unit (each block, the
  embedding, the norm + output), each paying the ring's latency, as often as the ZeRO stage,
  the accumulation and the pipeline schedule issue them (`comm_model.fsdp_calls`); beyond
  their α–β time each all-gather costs `Cluster.fsdp_gather_s` and each reduce-scatter
  `Cluster.fsdp_reduce_s` (the copies through FSDP2's flat buffers; calibrated,
  `titanlab.planning.calibrate_fsdp`).
- Ranks sharing CPU cores (more ranks than `Cluster.shared_cores`): compute slows by ranks ÷
  cores; the pipeline bubble is free at twice as many ranks as cores (an idle rank gives its
  core away) and costs in proportion below that; nothing overlaps (the cores move the bytes):
  every collective is exposed whole. α and β are calibrated with all the ranks on the shared
  cores.
- Split backward (zero-bubble schedules): `Cluster.split_backward_s` per block backward that
  torch splits into an input and a weight half (every "I" of the busiest rank's schedule order
  but on the first stage), × the shared-core slowdown (`split_blocks`).
- Tensor parallel's overhead beyond its FLOPs and collectives (DTensor's dispatch, smaller
  GEMMs): `Cluster.tp_block_s` per block forward and backward of the busiest rank, measured
  with every rank running (`titanlab.planning.calibrate_tp`).
- MFU: model FLOPs (no recomputation) ÷ (step time × devices × the bf16 peak), the trainer's
  convention (`titanlab.metrics`), also for float8 runs (a calibrated CPU profile without a
  bf16 peak: of its measured GEMM rate).

Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlab.planning.cluster import Cluster
from titanlab.planning.compute_costs import ComputeCosts
from titanlab.planning.comm_model import (  # noqa: F401 (MESH_ORDER, intra_node: public here too)
    MESH_ORDER,
    Comm,
    _communication,
    fsdp_calls,
    intra_node,
)
from titanlab.planning.layouts import Layout
from titanlab.planning.model_shape import ModelShape
from titanlab.planning.optimizer_cost import optimizer_seconds

DP_DIMS = ("dp_shard", "dp_shard+cp", "dp_replicate")
"""The mesh dimensions whose collectives overlap the compute together (one link, one window)."""


@dataclass(frozen=True)
class Run:
    """The work of one optimizer step, independent of the layout."""

    seq_len: int
    global_batch: int
    """Samples per optimizer step."""
    ac_mode: str = "none"
    """none | full | selective_op | selective_<k>."""
    param_bytes: int = 2
    """Bytes per element of the gathered weights and activations (bf16: 2)."""
    grad_bytes: int = 4
    """Bytes per element of the gradients reduced (fp32: 4)."""
    dtype: str = "bfloat16"
    """The compute dtype of the Linear layers (float8: their GEMMs at the float8 peak)."""
    pp_microbatch_size: int = 1
    looped_stages_per_rank: int = 2
    """`parallelism.pipeline_parallel_stages_per_rank` (Interleaved1F1B, LoopedBFS, ...)."""
    layers_per_stage: int = -1
    """`parallelism.pipeline_parallel_layers_per_stage` (-1: `layers_per_stage`'s auto split)."""
    fsdp_reshard_after_forward: str = "default"
    """`parallelism.fsdp_reshard_after_forward` (ZeRO 3): default | always | never."""
    optimizer: str = "AdamW"
    """`optimizer.name`: AdamW | Muon."""
    muon_ns_steps: int = 5
    muon_ns_dtype: str = "bfloat16"


@dataclass
class Prediction:
    """A layout's predicted step on a cluster (seconds; MFU and bubble fractions)."""

    layout: Layout
    step_s: float
    compute_s: float
    bubble: float
    """Pipeline idle time ÷ the busiest stage's compute (can exceed 1)."""
    bubble_s: float
    optimizer_s: float
    comm: list[Comm] = field(default_factory=list)
    mfu: float = 0.0
    tokens_per_s_per_device: float = 0.0
    split_backward_s: float = 0.0
    """What splitting the backward (zero-bubble schedules) adds: `Cluster.split_backward_s` per
    split block backward."""
    tp_overhead_s: float = 0.0
    """What tensor parallel adds beyond FLOPs and collectives: `Cluster.tp_block_s` per block
    forward and backward of the busiest rank."""
    fsdp_overhead_s: float = 0.0
    """What FSDP2 adds beyond its collectives' α–β time: `Cluster.fsdp_gather_s` per
    all-gather and `Cluster.fsdp_reduce_s` per reduce-scatter (`comm_model.fsdp_calls`)."""

    @property
    def exposed_comm_s(self) -> float:
        """Seconds of communication the step waits for, all collectives together."""
        return sum(c.exposed for c in self.comm)


def recompute_flops_per_token(shape: ModelShape, seq_len: int, ac_mode: str) -> tuple[float, float]:
    """(matmul, attention) FLOPs per token that `ac_mode` recomputes in backward (whole model;
    see the module docstring). ValueError for an unknown mode."""
    block_forward = 2 * shape.n_layers * shape.block_active_params
    attention_forward = shape.attention_flops_per_token(seq_len) / 3
    if ac_mode == "none":
        return 0.0, 0.0
    if ac_mode == "full":
        return block_forward, attention_forward
    if ac_mode == "selective_op":
        return block_forward / 2, 0.0
    if ac_mode.startswith("selective_") and ac_mode.split("_", 1)[1].isdigit():
        every = int(ac_mode.split("_", 1)[1])
        return block_forward / every, attention_forward / every
    raise ValueError(f"ac_mode={ac_mode!r}: use none, full, selective_op or selective_<k>")


def recompute_factor(shape: ModelShape, seq_len: int, ac_mode: str) -> float:
    """Training FLOPs with recomputation ÷ without."""
    base = shape.flops_per_token(seq_len)
    return (base + sum(recompute_flops_per_token(shape, seq_len, ac_mode))) / base


def bubble_fraction(schedule: str | None, pp: int, microbatches: int, per_rank: int) -> float:
    """Idle time ÷ compute of a pipeline stage (see the module docstring); ValueError for a
    schedule this model does not know."""
    if pp <= 1 or schedule is None:
        return 0.0
    m = max(microbatches, 1)
    if schedule in ("GPipe", "1F1B"):
        return (pp - 1) / m
    if schedule in ("Interleaved1F1B", "LoopedBFS"):
        return (pp - 1) / (per_rank * m)
    if schedule == "InterleavedZeroBubble":
        return (pp - 1) / (3 * per_rank * m)
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return (pp - 1) / (6 * m)
    raise ValueError(f"pipeline schedule {schedule!r} has no bubble model")


@dataclass(frozen=True)
class _Work:
    """Per-rank quantities of one step that the compute and communication terms share."""

    local: int  # samples per rank per accumulation step
    pp_microbatches: int  # pipeline microbatches per accumulation step (1 without PP)
    microbatches: int  # forward passes per rank per step
    per_rank: int  # pipeline stages per rank
    blocks: int  # blocks of the busiest pipeline rank
    has_head: bool  # whether the busiest rank holds the output head
    has_embedding: bool = True  # whether it holds the embedding (the first stage)

    @property
    def samples_per_microbatch(self) -> int:
        return self.local // self.pp_microbatches

    @property
    def units(self) -> int:
        """FSDP units of the busiest rank (`apply_fsdp`): its blocks, the embedding, the norm +
        output."""
        return self.blocks + self.has_embedding + self.has_head


def _work(shape: ModelShape, run: Run, lay: Layout) -> _Work:
    dp = lay.dp_replicate * lay.dp_shard
    if run.global_batch % (dp * lay.grad_accum):
        raise ValueError(
            f"global batch {run.global_batch} does not split over dp {dp} × grad_accum "
            f"{lay.grad_accum}"
        )
    local = run.global_batch // (dp * lay.grad_accum)
    if lay.pp <= 1 or not lay.schedule:
        return _Work(local, 1, lay.grad_accum, 1, shape.n_layers, True)
    from titanlab.distributed.pipeline import layers_per_stage, stage_ids, stages_per_rank

    per_rank = stages_per_rank(lay.schedule, run.looped_stages_per_rank)
    stages = lay.pp * per_rank
    counts = layers_per_stage(shape.n_layers, stages, run.layers_per_stage)
    block_cost, head_cost = 6 * shape.block_active_params, 6 * shape.output_params
    ranks = []
    for r in range(lay.pp):
        ids = stage_ids(lay.schedule, r, lay.pp, per_rank)
        blocks, head = sum(counts[i] for i in ids), stages - 1 in ids
        ranks.append((blocks * block_cost + head * head_cost, blocks, head, 0 in ids))
    _, blocks, head, first = max(ranks)
    pp_mb = max(local // run.pp_microbatch_size, 1)
    return _Work(local, pp_mb, lay.grad_accum * pp_mb, per_rank, blocks, head, first)


def predict(
    shape: ModelShape, run: Run, lay: Layout, cluster: Cluster, costs: ComputeCosts | None = None
) -> Prediction:
    """The predicted step of `lay` for `run` on `cluster` (see the module docstring). With
    `costs` (the per-op ledger's, on a GPU profile) the compute and optimizer terms are
    theirs: `global_batch / dp` sequences through the busiest rank's blocks, split over tp × cp,
    and the update of the parameters it holds.

    Raises ValueError when the global batch does not split over dp × grad_accum, for a ZeRO
    stage outside 0-3, an unknown AC mode or pipeline schedule; ConfigError when the cluster has
    no peak for the run's dtype."""
    if lay.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={lay.zero_stage}: use 0, 1, 2 or 3")
    eff, world = cluster.efficiency, lay.world_size
    work = _work(shape, run, lay)
    tokens_global = run.global_batch * run.seq_len
    devices_per_replica = world / lay.pp  # the dp × cp × tp ranks that split one stage's work
    block_share = work.blocks / shape.n_layers
    redo_mm, redo_attn = recompute_flops_per_token(shape, run.seq_len, run.ac_mode)
    mm = 6 * shape.block_active_params * shape.n_layers * block_share + redo_mm * block_share
    mm += 6 * shape.output_params * work.has_head
    attn = (shape.attention_flops_per_token(run.seq_len) + redo_attn) * block_share
    mm_peak = cluster.flops(run.dtype)
    attn_peak = cluster.flops("bfloat16" if run.dtype == "float8" else run.dtype)
    slowdown = max(1.0, world / cluster.shared_cores) if cluster.shared_cores else 1.0
    gemm_s = mm * tokens_global / devices_per_replica / (mm_peak * eff.matmul)
    attn_s = attn * tokens_global / devices_per_replica / (attn_peak * eff.attention)
    compute_s = (gemm_s * (1 + eff.pointwise) + attn_s) * slowdown
    if costs is not None:
        sequences = run.global_batch / (lay.dp_replicate * lay.dp_shard)
        one = costs.sequence_s(work.blocks, work.has_head, work.has_embedding)
        compute_s = one * sequences / (lay.tp * lay.cp) * slowdown
    bubble = bubble_fraction(lay.schedule, lay.pp, work.pp_microbatches, work.per_rank)
    # Ranks sharing cores: a rank idle in the bubble gives its core to another; with twice as
    # many ranks as cores the bubble costs nothing.
    bubble_s = compute_s * bubble * max(0.0, 2.0 - slowdown)

    comm = _communication(shape, run, lay, cluster, work)
    if slowdown > 1:
        _set_exposed_shared_cores(comm)
    else:
        _set_exposed(comm, compute_s, lay, work, cluster.device_type)
    shard = lay.tp * lay.pp * (lay.dp_shard * lay.cp if lay.zero_stage >= 1 else 1)
    optimizer_s = optimizer_seconds(shape, run, shard, cluster)  # optimizer_cost.py
    if costs is not None:
        optimizer_s = costs.update_s_per_param * shape.total_params / shard
    split_s = cluster.split_backward_s * split_blocks(shape, run, lay, work) * slowdown
    # measured with every rank running (the shared cores' slowdown included)
    tp_s = cluster.tp_block_s * work.blocks * work.microbatches if lay.tp > 1 else 0.0
    fsdp_s = 0.0
    if lay.dp_shard * lay.cp > 1:
        gathers, reduces = fsdp_calls(lay, run, work)
        fsdp_s = gathers * cluster.fsdp_gather_s + reduces * cluster.fsdp_reduce_s
        if costs is not None:  # FSDP2's buffer copies as the ledger prices them
            moved = sum(c.bytes for c in comm if c.dim in ("dp_shard", "dp_shard+cp")
                        and c.kind in ("all-gather", "reduce-scatter"))  # fmt: skip
            fsdp_s += costs.fsdp_copy_s_per_byte * moved
    overheads = split_s + tp_s + fsdp_s
    step_s = compute_s + bubble_s + optimizer_s + overheads + sum(c.exposed for c in comm)
    flops = shape.flops_per_token(run.seq_len) * tokens_global
    return Prediction(
        lay, step_s, compute_s, bubble, bubble_s, optimizer_s, comm,
        mfu=flops / (step_s * world * (cluster.peak_flops.get("bfloat16") or mm_peak)),
        tokens_per_s_per_device=tokens_global / step_s / world, split_backward_s=split_s,
        tp_overhead_s=tp_s, fsdp_overhead_s=fsdp_s,
    )  # fmt: skip


def split_blocks(shape: ModelShape, run: Run, lay: Layout, work: _Work) -> int:
    """Block backwards a zero-bubble schedule splits into an input and a weight half in one
    step, on the pipeline rank with the most: each "I" of torch's schedule order for that rank
    (`titanlab.planning.pipeline_memory.rank_actions`) counts its stage's blocks, but on the
    first stage, whose weight half runs the whole backward; 0 for other schedules."""
    if lay.pp <= 1 or not lay.schedule:
        return 0
    from titanlab.distributed.pipeline import layers_per_stage, stages_per_rank
    from titanlab.planning.pipeline_memory import rank_actions

    per_rank = stages_per_rank(lay.schedule, run.looped_stages_per_rank)
    counts = layers_per_stage(shape.n_layers, lay.pp * per_rank, run.layers_per_stage)
    order = rank_actions(lay.schedule, lay.pp, work.pp_microbatches, run.looped_stages_per_rank)
    split = max(sum(counts[s] for kind, s in acts if kind == "I" and s) for acts in order.values())
    return lay.grad_accum * split


def _set_exposed_shared_cores(comm: list[Comm]) -> None:
    """Exposure when ranks outnumber the cores they share (CPU): every collective is waited
    for whole. Nothing overlaps compute for free, since moving bytes takes the same cores, and
    a rank blocked in a collective waits for its peers to be scheduled (α, calibrated with the
    ranks on the shared cores); FSDP2's collectives on CPU block where they are issued (see
    `_set_exposed`)."""
    for c in comm:
        c.exposed = c.seconds


def _set_exposed(
    comm: list[Comm], compute_s: float, lay: Layout, work: _Work, device_type: str = "cuda"
) -> None:
    """Each collective's exposed seconds (see the module docstring's overlap rules). On CPU
    FSDP2 (and its `replicate`) waits for each collective where it issues it: it all-gathers
    before a unit's forward without prefetching (`FSDPParamGroup.unshard_async_op` is false)
    and reduces on the current stream, CPU having no other (torch 2.13); so the
    data-parallel collectives are exposed whole there."""
    dp = [c for c in comm if c.dim in DP_DIMS]
    dp_s = sum(c.seconds for c in dp)
    # the first unit's all-gather and the last unit's reduction have no compute to hide behind
    ends = sum(c.seconds / c.calls for c in dp if c.calls)
    dp_exposed = max(0.0, dp_s - compute_s) + ends
    hidden = device_type != "cpu"
    for c in dp:
        c.exposed = min(c.seconds, dp_exposed * c.seconds / dp_s) if hidden else c.seconds
    for c in comm:
        if c.dim in DP_DIMS:
            continue
        if c.kind == "send":  # only the pipeline's fill and drain wait for a send
            c.exposed = c.seconds * 2 * (lay.pp - 1) / max(2 * work.microbatches, 1)
        else:
            c.exposed = c.seconds
