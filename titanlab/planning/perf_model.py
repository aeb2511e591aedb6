"""Predicted step time of a parallel layout on a cluster: compute, pipeline bubble, optimizer and
the communication left exposed (docs/planning.md writes the model out with its sources).

- Compute: training FLOPs per token (6 × the matmul weights a token meets, an MoE layer's
  experts at top_k / num_experts, + 12·L·H·Q·s of attention; Kaplan et al. 2020, PaLM
  Appendix B), recomputation added per AC mode (full: the forward again, 8/6 of the work;
  selective op: attention's forward, 4/12 of it; every k-th block: full on 1/k of them), split
  evenly over tp × cp × dp, the pipeline's costliest stage setting the pace; time = FLOPs ÷
  (peak × the kernel class's efficiency), pointwise work a share of the GEMM time.
- Pipeline bubble, as a fraction of a stage's work, for p stages, m microbatches and v stages
  per rank: GPipe and 1F1B (p−1)/m (Huang et al. 2019; Narayanan et al. 2021), interleaved
  (Interleaved1F1B, LoopedBFS) (p−1)/(v·m) (Narayanan et al. 2021 §2.2), zero-bubble schedules a
  third of their base's (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"; ZBV and
  DualPipeV at v = 2: (p−1)/(6m)).
- Communication: per mesh dimension, a ring (NCCL's bandwidth-optimal algorithm): all-gather
  and reduce-scatter of M bytes over n ranks (n−1)·α + (n−1)/n · M / β, all-reduce twice that,
  all-to-all as one all-gather, a point-to-point send α + M / β (the α–β model, Hockney 1994;
  Thakur et al. 2005). β is the intra-node link when the group's ranks are on one node (mesh
  order pp, dp_replicate, dp_shard, cp, tp, outermost first, as `ParallelDims` builds it), else
  the inter-node one.
- Overlap: FSDP's all-gathers and reduce-scatters run behind the compute of other blocks (all
  but the first all-gather of a step, one unit's); DDP's and HSDP's all-reduce behind the
  backward (2/3 of the compute); TP's, CP's and EP's collectives are on the critical path; of
  the pipeline's sends only the fill and drain are.

Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from titanlab.planning.cluster import Cluster
from titanlab.planning.layouts import Layout

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Outermost first: `ParallelDims`' mesh order; the innermost dims are the nearest ranks."""


@dataclass(frozen=True)
class ModelShape:
    """What the model contributes to the performance model (parameter counts, not bytes)."""

    n_layers: int
    dim: int
    n_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    block_params: int
    """Weights of one block, experts excluded (the mean over blocks)."""
    expert_params: int
    """All routed experts of all MoE layers together."""
    moe_layers: int
    top_k: int
    num_experts: int
    embedding_params: int
    output_params: int
    """The output head's weights (a head tied to the embedding multiplies by the embedding's:
    its matmul runs all the same, though `total_params` counts the weights once)."""
    total_params: int

    @classmethod
    def of(cls, model_args) -> ModelShape:
        """From a registered family's args (a meta model is built to count)."""
        import torch

        from titanlab.models.common.decoder import count_params, moe_layers
        from titanlab.models.registry import build_model

        with torch.device("meta"):
            model = build_model(model_args)
        moes = moe_layers(model)
        experts = sum(count_params(m.experts) for m in moes)
        emb = getattr(model, "tok_embeddings", None)
        out = getattr(model, "output", None)
        tied = out is not None and emb is not None and out.weight is emb.weight
        emb_n = emb.weight.numel() if emb is not None else 0
        out_n = 0 if out is None or tied else out.weight.numel()
        total = count_params(model)
        norm = getattr(model, "norm", None)
        norm_n = count_params(norm) if norm is not None else 0
        blocks = total - emb_n - out_n - experts - norm_n
        return cls(
            n_layers=model_args.n_layers,
            dim=model_args.dim,
            n_heads=model_args.n_heads,
            kv_heads=model_args.kv_heads,
            head_dim=model_args.head_dim,
            vocab_size=model_args.vocab_size,
            block_params=blocks // model_args.n_layers,
            expert_params=experts,
            moe_layers=len(moes),
            top_k=moes[0].args.top_k if moes else 0,
            num_experts=moes[0].args.num_experts if moes else 0,
            embedding_params=emb_n,
            output_params=out_n if not tied else emb_n,
            total_params=total,
        )

    def matmul_flops_per_token(self) -> int:
        """6 × the weights a token is multiplied by (blocks, its experts' share, the head)."""
        active_experts = self.expert_params * self.top_k // max(self.num_experts, 1)
        return 6 * (self.n_layers * self.block_params + active_experts + self.output_params)

    def attention_flops_per_token(self, seq_len: int) -> int:
        return 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token without recomputation (what MFU counts)."""
        return self.matmul_flops_per_token() + self.attention_flops_per_token(seq_len)


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
    pp_microbatch_size: int = 1


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
    intra_node: bool = True


@dataclass
class Prediction:
    """A layout's predicted step on a cluster (seconds; MFU a fraction)."""

    layout: Layout
    step_s: float
    compute_s: float
    bubble: float
    bubble_s: float
    optimizer_s: float
    comm: list[Comm] = field(default_factory=list)
    mfu: float = 0.0
    tokens_per_s_per_device: float = 0.0

    @property
    def exposed_comm_s(self) -> float:
        return sum(c.exposed for c in self.comm)


def recompute_factor(shape: ModelShape, seq_len: int, ac_mode: str) -> float:
    """Training work with recomputation ÷ without (see the module docstring)."""
    base = shape.flops_per_token(seq_len)
    forward = base / 3  # forward is 2 of the 6 FLOPs per weight, and of attention's 12
    if ac_mode == "full":
        return (base + forward) / base
    if ac_mode == "selective_op":
        return (base + shape.attention_flops_per_token(seq_len) / 3) / base
    if ac_mode.startswith("selective_"):
        every = int(ac_mode.split("_", 1)[1])
        return (base + forward / every) / base
    return 1.0


def bubble_fraction(schedule: str | None, pp: int, microbatches: int, per_rank: int) -> float:
    """Idle time ÷ work of a pipeline stage (see the module docstring)."""
    if pp <= 1 or schedule is None:
        return 0.0
    m = max(microbatches, 1)
    if schedule in ("GPipe", "1F1B"):
        return (pp - 1) / m
    if schedule in ("Interleaved1F1B", "LoopedBFS"):
        return (pp - 1) / (per_rank * m)
    if schedule == "InterleavedZeroBubble":
        return (pp - 1) / (3 * per_rank * m)
    return (pp - 1) / (6 * m)  # ZBVZeroBubble, DualPipeV: zero-bubble at v = 2


def _degrees(lay: Layout) -> dict[str, int]:
    return {"pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
            "cp": lay.cp, "tp": lay.tp}  # fmt: skip


def intra_node(lay: Layout, dims: tuple[str, ...], cluster: Cluster) -> bool:
    """Whether the group over `dims` (adjacent in `MESH_ORDER`) lies on one node."""
    deg = _degrees(lay)
    inner = MESH_ORDER[MESH_ORDER.index(dims[-1]) + 1 :]
    stride = math.prod(deg[d] for d in inner)
    span = stride * math.prod(deg[d] for d in dims)
    return span <= cluster.devices_per_node


def _ring(kind: str, n: int, nbytes: float, calls: int, intra: bool, cluster: Cluster) -> float:
    """Seconds of `calls` collectives of `nbytes` each over a ring of `n` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw = (cluster.intra_bandwidth if intra else cluster.inter_bandwidth) * cluster.efficiency.link
    alpha = cluster.intra_latency if intra else cluster.inter_latency
    if kind == "send":
        return calls * (alpha + nbytes / bw)
    one = (n - 1) * alpha + (n - 1) / n * nbytes / bw
    return calls * (2 * one if kind == "all-reduce" else one)


def predict(shape: ModelShape, run: Run, lay: Layout, cluster: Cluster) -> Prediction:
    """The predicted step of `lay` for `run` on `cluster` (see the module docstring)."""
    eff, peak = cluster.efficiency, cluster.flops(run.dtype)
    world = lay.world_size
    dp = lay.dp_replicate * lay.dp_shard
    local = run.global_batch // (dp * lay.grad_accum)  # samples per rank per accumulation step
    pp_mb = max(local // run.pp_microbatch_size, 1) if lay.pp > 1 else 1
    microbatches = lay.grad_accum * pp_mb  # forward passes per rank per step
    tokens_global = run.global_batch * run.seq_len
    per_rank = _stages_per_rank(lay)

    # Compute: even split over tp × cp × dp, the costliest pipeline stage's share.
    stage_share = _last_stage_share(shape, lay.pp, per_rank)
    redo = recompute_factor(shape, run.seq_len, run.ac_mode)
    mm = shape.matmul_flops_per_token() * tokens_global * redo / world * stage_share
    attn = shape.attention_flops_per_token(run.seq_len) * tokens_global * redo / world
    attn *= stage_share
    slowdown = max(1.0, world / cluster.shared_cores) if cluster.shared_cores else 1.0
    gemm_s = mm / (peak * eff.matmul)
    compute_s = (gemm_s * (1 + eff.pointwise) + attn / (peak * eff.attention)) * slowdown
    bubble = bubble_fraction(lay.schedule, lay.pp, pp_mb, per_rank)
    bubble_s = compute_s * bubble

    comm = _communication(shape, run, lay, cluster, local, microbatches, pp_mb)
    for c in comm:
        if c.dim in ("dp_shard", "dp_shard+cp"):  # behind compute but a step's first unit
            units = shape.n_layers // lay.pp + 2
            first = c.seconds / (c.calls * units) if c.kind == "all-gather" else 0.0
            c.exposed = max(0.0, c.seconds - compute_s) + first
        elif c.kind == "all-reduce" and c.dim == "dp_replicate":
            c.exposed = max(0.0, c.seconds - 2 / 3 * compute_s)
        elif c.kind == "send":
            c.exposed = c.seconds * 2 * (lay.pp - 1) / max(2 * microbatches, 1)
        else:
            c.exposed = c.seconds

    shard = lay.tp * lay.pp * (lay.dp_shard * lay.cp if lay.zero_stage >= 1 else 1)
    optimizer_s = 28 * shape.total_params / shard / (cluster.memory_bandwidth * eff.optimizer)
    step_s = compute_s + bubble_s + optimizer_s + sum(c.exposed for c in comm)
    flops = shape.flops_per_token(run.seq_len) * tokens_global
    return Prediction(
        lay, step_s, compute_s, bubble, bubble_s, optimizer_s, comm,
        mfu=flops / (step_s * world * peak),
        tokens_per_s_per_device=tokens_global / step_s / world,
    )  # fmt: skip


def _stages_per_rank(lay: Layout) -> int:
    from titanlab.distributed.pipeline import stages_per_rank

    return stages_per_rank(lay.schedule, 2) if lay.pp > 1 and lay.schedule else 1


def _last_stage_share(shape: ModelShape, pp: int, per_rank: int) -> float:
    """The costliest rank's share of the model's matmul work × pp (1.0 when balanced): the
    blocks split evenly over pp × per_rank stages, the output head on the last rank."""
    if pp <= 1:
        return 1.0
    active_experts = shape.expert_params * shape.top_k / max(shape.num_experts, 1)
    block = 6 * (shape.block_params + active_experts / shape.n_layers)
    total = shape.n_layers * block + 6 * shape.output_params
    stages = pp * per_rank
    blocks_per_stage = math.ceil(shape.n_layers / stages)
    last = per_rank * blocks_per_stage * block + 6 * shape.output_params
    return min(max(last / (total / pp), 1.0), float(pp))


def _communication(
    shape: ModelShape, run: Run, lay: Layout, cluster: Cluster, local: int, micro: int, pp_mb: int
) -> list[Comm]:
    out: list[Comm] = []
    e, g = run.param_bytes, run.grad_bytes
    stage_params = shape.total_params / lay.pp / lay.tp
    fsdp = lay.dp_shard * lay.cp
    if fsdp > 1:
        dims = ("dp_shard", "cp") if lay.cp > 1 else ("dp_shard",)
        intra = intra_node(lay, dims, cluster)
        gathers = {3: 2 * micro, 2: micro, 1: 1, 0: 0}[lay.zero_stage]
        reduces = micro if lay.zero_stage >= 2 else 1
        name = "+".join(dims)
        for kind, calls, nbytes in (("all-gather", gathers, stage_params * e),
                                    ("reduce-scatter", reduces, stage_params * g)):  # fmt: skip
            if calls:
                t = _ring(kind, fsdp, nbytes, calls, intra, cluster)
                out.append(Comm(kind, name, fsdp, calls * nbytes, t, calls, intra_node=intra))
    if lay.dp_replicate > 1:
        intra = intra_node(lay, ("dp_replicate",), cluster)
        nbytes = stage_params / fsdp * g
        t = _ring("all-reduce", lay.dp_replicate, nbytes, 1, intra, cluster)
        out.append(
            Comm("all-reduce", "dp_replicate", lay.dp_replicate, nbytes, t, 1, intra_node=intra)
        )
    tokens_mb = (local // pp_mb if lay.pp > 1 else local) * run.seq_len // lay.cp
    layers = shape.n_layers // lay.pp
    if lay.tp > 1:  # Megatron + SP: 2 all-gathers and 2 reduce-scatters forward, as many back
        intra = intra_node(lay, ("tp",), cluster)
        nbytes = tokens_mb * shape.dim * e
        calls = 4 * layers * micro
        for kind in ("all-gather", "reduce-scatter"):
            t = _ring(kind, lay.tp, nbytes, calls, intra, cluster)
            out.append(Comm(kind, "tp", lay.tp, calls * nbytes, t, calls, intra_node=intra))
    if lay.cp > 1:  # K and V gathered forward, their gradients reduce-scattered backward
        intra = intra_node(lay, ("cp",), cluster)
        kv = 2 * tokens_mb * lay.cp * shape.kv_heads * shape.head_dim // lay.tp * e
        for kind in ("all-gather", "reduce-scatter"):
            t = _ring(kind, lay.cp, kv, layers * micro, intra, cluster)
            out.append(
                Comm(kind, "cp", lay.cp, layers * micro * kv, t, layers * micro, intra_node=intra)
            )
    if lay.ep > 1 and shape.moe_layers:  # dispatch and combine, forward and backward
        intra = lay.ep <= cluster.devices_per_node
        nbytes = tokens_mb // lay.tp * shape.top_k * shape.dim * e
        calls = 4 * (shape.moe_layers // lay.pp) * micro
        t = _ring("all-to-all", lay.ep, nbytes, calls, intra, cluster)
        out.append(Comm("all-to-all", "ep", lay.ep, calls * nbytes, t, calls, intra_node=intra))
    if lay.pp > 1:  # each microbatch's activations forward and their gradient backward
        intra = intra_node(lay, ("pp",), cluster)
        nbytes = tokens_mb * shape.dim // lay.tp * e
        calls = 2 * micro * _stages_per_rank(lay)
        t = _ring("send", 2, nbytes, calls, intra, cluster)
        out.append(Comm("send", "pp", lay.pp, calls * nbytes, t, calls, intra_node=intra))
    return out
