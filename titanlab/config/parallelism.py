"""The `[parallelism]` section: degrees of each parallelism and pipeline options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlab.config.errors import ConfigError, _require  # noqa: F401

CPRotateMethod = Literal["allgather", "alltoall"]
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

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward (saves memory, costs an all-gather in backward).
    default: reshard every block except the root."""

    tensor_parallel_degree: int = 1
    """tp: tensor parallel degree (Megatron-style, always with sequence parallel for the norms)."""

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

    pipeline_parallel_module_fqns_per_stage: list[str] = field(default_factory=list)
    """Manual split: one entry per stage, the module names separated by spaces, e.g.
    "tok_embeddings layers.0 layers.1". Overrides the automatic split."""

    context_parallel_degree: int = 1
    """cp: context parallel degree: each sample's sequence is split over cp ranks (ring
    attention through SDPA; on CPU through the CPU flash kernel)."""

    context_parallel_rotate_method: CPRotateMethod = "allgather"
    """How the ring passes key/value shards between the cp ranks: all-gather them once per
    attention call, or pass them round the ring with all-to-all steps."""

    expert_parallel_degree: int = 1
    """ep: MoE models only. The routed experts are split over ep ranks (each holds
    num_experts / ep of them) and tokens travel to their experts by all-to-all. ep is taken
    from the ranks that hold different tokens, innermost first: it must be a multiple of
    cp × tp and divide dp_shard × cp × tp. The expert weights are FSDP-sharded over the
    dp_shard ranks ep leaves (efsdp = dp_shard × cp × tp / ep); the dense weights keep the
    usual FSDP mesh."""

    def validate(self) -> None:
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
