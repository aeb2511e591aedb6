"""The `[parallelism]` section: degrees of each parallelism and pipeline options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlab.config.errors import ConfigError, _require  # noqa: F401

CPRotateMethod = Literal["allgather", "alltoall"]
CPMode = Literal["ring", "ulysses"]
CPLoadBalancer = Literal["auto", "work", "head_tail", "none"]
TensorParallelMode = Literal["1d", "2d", "2.5d", "3d"]
ShardingStrategy = Literal["", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
# FSDP1's (and DeepSpeed users') names for the ZeRO stages.
STRATEGY_STAGES = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3}
PipelineSchedule = Literal[
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """dp_replicate: number of model replicas (HSDP's replicate dimension; DDP-like all-reduce)."""

    data_parallel_shard_degree: int = -1
    """dp_shard: FSDP2 sharding degree. -1: whatever the other degrees leave of the world size."""

    zero_stage: int = 3
    """What the data-parallel ranks (dp_shard) split among themselves, by ZeRO's stages
    (Rajbhandari et al. 2020, arXiv:1910.02054), on FSDP2 and DDP:
    3: parameters, gradients and optimizer state (`fully_shard`: each block's parameters are
    all-gathered for its forward and again for its backward);
    2: gradients and optimizer state: each block's parameters are all-gathered once per step
    and kept through every microbatch's forward and backward (`reshard_after_forward=False`,
    not resharded between gradient-accumulation microbatches), gradients reduce-scattered per
    microbatch;
    1: optimizer state: as 2, but the whole gradients accumulate over the microbatches and
    are reduce-scattered once per step;
    0: nothing (DDP: the dp_shard ranks become replicas, gradients all-reduced).
    Bytes sent per step (Ψ the gradient bytes, §7 of the paper): 3Ψ at stage 3, 2Ψ at 0-2.
    With training.enable_cpu_offload, stages 2 and 3 are ZeRO-Offload."""

    fsdp_sharding_strategy: ShardingStrategy = ""
    """The same choice by FSDP1's names: FULL_SHARD (zero_stage 3), SHARD_GRAD_OP (2),
    NO_SHARD (0), HYBRID_SHARD (3 within each of data_parallel_replicate_degree replicas,
    i.e. HSDP; needs both degrees > 1). Empty: zero_stage decides."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward (saves memory, costs an all-gather in backward).
    default: reshard every block except the root."""

    tensor_parallel_degree: int = 1
    """tp: tensor parallel degree (Megatron-style, always with sequence parallel for the norms)."""

    tensor_parallel_mode: TensorParallelMode = "1d"
    """How the tp ranks split each layer. 1d: Megatron's column / row split with sequence parallel.
    2d: the tp ranks as a q × q grid (tp = q², e.g. 4 or 9), every Linear's weight split on both
    grid dimensions and the activations by batch rows and features (Optimus, Xu et al. 2021,
    arXiv:2104.05343, on SUMMA products; titanlab/distributed/tensor_parallel/two_d.py): 1/q² of
    each weight per rank, heads split over q only. 2.5d: `tensor_parallel_depth` = d stacked q × q
    grids (tp = q²·d; Tesseract, Wang et al. 2021, arXiv:2105.14500), the batch split over them too,
    each grid's weights replicated across them. 3d: a q × q × q cube (tp = q³, e.g. 8; Bian et al.
    2021, arXiv:2105.14450; titanlab/distributed/tensor_parallel/three_d.py), 1/q³ of each weight
    per rank. 2d / 2.5d / 3d compose with FSDP / HSDP / DDP and PP (not CP or EP yet), dense models
    without q/k norms."""

    tensor_parallel_depth: int = 1
    """d of 2.5D tensor parallel: tensor_parallel_degree = q² · d. 1 with 1d and 2d."""

    disable_loss_parallel: bool = False
    """Under tp, gather the full-vocab logits before the loss instead of computing the
    cross-entropy on vocab-sharded logits (loss parallel). Distillation always gathers them
    (the KL to the teacher needs whole-vocab rows)."""

    pipeline_parallel_degree: int = 1
    """pp: pipeline parallel degree (number of pipeline ranks)."""

    pipeline_parallel_schedule: PipelineSchedule = "1F1B"
    """Pipeline schedule, used when pipeline_parallel_degree > 1."""

    pipeline_parallel_microbatch_size: int = 1
    """Samples per pipeline microbatch; local_batch_size / this = microbatches per step."""

    pipeline_parallel_stages_per_rank: int = 2
    """Stages each rank holds for the looped schedules (Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble). GPipe/1F1B use 1, ZBVZeroBubble/DualPipeV 2."""

    pipeline_parallel_layers_per_stage: int = -1
    """Blocks per pipeline stage (the first and last stage hold one fewer, for the embedding and
    the output). -1: split evenly, counting embedding and output as one block each."""

    pipeline_parallel_split: Literal["layers", "params", "flops"] = "layers"
    """What the automatic split balances: layers (equal blocks; embedding and output one block
    each), params (parameter counts: the weights, gradients and optimizer state each stage
    holds) or flops (training FLOPs per token, the output projection counted: with a large
    vocabulary the last stage takes fewer blocks). titanlab/distributed/pipeline_split.py."""

    pipeline_parallel_module_fqns_per_stage: list[str] = field(default_factory=list)
    """Manual split: one entry per stage, the module names separated by spaces, e.g.
    "tok_embeddings layers.0 layers.1". Overrides the automatic split."""

    context_parallel_degree: int = 1
    """cp: context parallel degree: each sample's sequence is split over cp ranks. Causal
    batches: PyTorch's ring attention through SDPA (on CPU through the CPU flash kernel);
    document masks, packed chat SFT and Ulysses: titanlab's CP attention
    (`context_parallel_mode`)."""

    context_parallel_rotate_method: CPRotateMethod = "allgather"
    """How the ring passes key/value shards between the cp ranks: all-gather them once per
    attention call, or pass them round the ring with all-to-all steps."""

    context_parallel_mode: CPMode = "ring"
    """ring: each rank keeps its sequence shard and its queries attend every key, the keys and
    values travelling between the ranks (Liu et al. 2023). ulysses: an all-to-all turns the
    sequence shards of q, k, v into head shards around attention and back (DeepSpeed-Ulysses,
    Jacobs et al. 2023, arXiv:2309.14509); heads must divide by tp × cp. Both take causal and
    document masks (data.document_mask, packed chat SFT);
    titanlab/distributed/context_parallel/documents.py."""

    context_parallel_load_balancer: CPLoadBalancer = "auto"
    """Which tokens each ring rank holds when a batch has a document mask: work (blocks of
    the window dealt by the attention work the mask gives them, heaviest first to the
    least-loaded rank), head_tail (chunks r and 2·cp−1−r of 2·cp, exact for one causal
    document) or none (contiguous). auto: work under ring, none under Ulysses (each rank
    attends the whole sequence for its heads: nothing to balance), which takes only none or
    auto. Causal batches without documents use head_tail (PyTorch's ring).
    titanlab/distributed/context_parallel/balance.py."""

    expert_parallel_degree: int = 1
    """ep: MoE models only. The routed experts are split over ep ranks (each holds
    num_experts / ep of them) and tokens travel to their experts by all-to-all. ep is taken
    from the ranks that hold different tokens, innermost first: it must be a multiple of
    cp × tp and divide dp_shard × cp × tp. The expert weights are FSDP-sharded over the
    dp_shard ranks ep leaves (efsdp = dp_shard × cp × tp / ep); the dense weights keep the
    usual FSDP mesh."""

    expert_capacity_factor: float = 0.0
    """ep > 1 only. 0: the exact all-to-all, no token slot dropped, whose split sizes a GPU run
    reads on the host (a sync per MoE layer and direction). > 0: each expert takes at most
    ceil(factor · slots / num_experts) of a rank's token slots (GShard's capacity), so the
    all-to-all has static splits and no host sync; slots past it are dropped and logged as
    moe/tokens_dropped. A factor of num_experts / top_k or more never drops one.
    titanlab/distributed/expert_capacity.py."""

    expert_dispatch_chunks: int = 1
    """With expert_capacity_factor > 0: the exchange cut into this many chunks of every
    expert's capacity (rounded up to a multiple of it), each chunk's all-to-alls running beside
    another chunk's experts (Tutel's overlap degree); 1: one exchange, waited for whole."""

    @property
    def cp_load_balancer(self) -> str:
        """The load balancer in force: `context_parallel_load_balancer`, with auto as the
        mode's (work under ring, none under Ulysses)."""
        if self.context_parallel_mode == "ulysses":
            return "none"
        balancer = self.context_parallel_load_balancer
        return "work" if balancer == "auto" else balancer

    def validate(self) -> None:
        _require(
            self.context_parallel_mode != "ulysses"
            or self.context_parallel_load_balancer in ("auto", "none"),
            f"parallelism.context_parallel_load_balancer={self.context_parallel_load_balancer} "
            "does not apply to context_parallel_mode=ulysses (each rank attends the whole "
            "sequence for its heads: nothing to balance); valid with ulysses: none or auto",
        )
        _require(
            self.data_parallel_replicate_degree >= 1,
            f"parallelism.data_parallel_replicate_degree={self.data_parallel_replicate_degree}"
            " must be >= 1",
        )
        _require(
            self.data_parallel_shard_degree == -1 or self.data_parallel_shard_degree >= 1,
            f"parallelism.data_parallel_shard_degree={self.data_parallel_shard_degree}"
            " must be -1 or >= 1",
        )
        for key in (
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "context_parallel_degree",
            "expert_parallel_degree",
            "pipeline_parallel_microbatch_size",
            "pipeline_parallel_stages_per_rank",
        ):
            value = getattr(self, key)
            _require(value >= 1, f"parallelism.{key}={value} must be >= 1")
        _require(
            self.expert_capacity_factor >= 0,
            f"parallelism.expert_capacity_factor={self.expert_capacity_factor} must be >= 0 "
            "(0: the exact exchange)",
        )
        _require(
            self.expert_capacity_factor == 0 or self.expert_parallel_degree > 1,
            f"parallelism.expert_capacity_factor={self.expert_capacity_factor} bounds expert "
            "parallel's exchange; it needs expert_parallel_degree > 1 (got 1), or set it to 0",
        )
        _require(
            self.expert_dispatch_chunks == 1
            or (self.expert_dispatch_chunks > 1 and self.expert_capacity_factor > 0),
            f"parallelism.expert_dispatch_chunks={self.expert_dispatch_chunks} must be 1, or > 1 "
            "with expert_capacity_factor > 0 (the exact exchange is not cut into chunks)",
        )
        _require(
            self.zero_stage in (0, 1, 2, 3),
            f"parallelism.zero_stage={self.zero_stage} is not valid; valid: 0, 1, 2, 3",
        )
        _require(
            self.tensor_parallel_depth == 1 or self.tensor_parallel_mode == "2.5d",
            f"parallelism.tensor_parallel_depth={self.tensor_parallel_depth} means 2.5D tensor "
            f"parallel, not tensor_parallel_mode={self.tensor_parallel_mode}; set "
            "tensor_parallel_mode=2.5d or depth 1",
        )
        _require(
            self.tensor_parallel_depth >= 1,
            f"parallelism.tensor_parallel_depth={self.tensor_parallel_depth} must be >= 1",
        )
        _require(
            self.pipeline_parallel_split == "layers"
            or (
                self.pipeline_parallel_layers_per_stage == -1
                and not self.pipeline_parallel_module_fqns_per_stage
            ),
            f"parallelism.pipeline_parallel_split={self.pipeline_parallel_split} balances the "
            "stages itself; it cannot be combined with pipeline_parallel_layers_per_stage or "
            "pipeline_parallel_module_fqns_per_stage (set one of them)",
        )
        strategy = self.fsdp_sharding_strategy
        _require(
            not strategy or self.zero_stage in (3, STRATEGY_STAGES[strategy]),
            f"parallelism.fsdp_sharding_strategy={strategy} means zero_stage "
            f"{STRATEGY_STAGES.get(strategy)}, not parallelism.zero_stage={self.zero_stage}; set "
            "one of them",
        )
        _require(
            self.zero_stage_in_force not in (1, 2) or self.fsdp_reshard_after_forward != "always",
            f"parallelism.zero_stage={self.zero_stage_in_force} keeps parameters gathered from "
            "forward to backward, not parallelism.fsdp_reshard_after_forward=always; use "
            "zero_stage 3 or fsdp_reshard_after_forward=default",
        )

    @property
    def zero_stage_in_force(self) -> int:
        """The ZeRO stage in force: `fsdp_sharding_strategy`'s when set, else `zero_stage`."""
        strategy = self.fsdp_sharding_strategy
        return STRATEGY_STAGES[strategy] if strategy else self.zero_stage
