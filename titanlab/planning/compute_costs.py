"""The planner's compute and optimizer terms as the per-op ledger prices them: one sequence
through one device's blocks, head and embedding, and the update per parameter, on the target
GPU's code path and roofline (`titanlab.ledger.planner_costs` records them; `perf_model.predict`
scales them to a layout). The same pricing as `titanlab ledger`, so the planner's step and the
ledger's agree on the layout the ledger can record (one that does not pipeline)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeCosts:
    """Seconds on one device of the target GPU for one sequence of `seq_len` tokens, no
    parallelism, in one activation-checkpointing mode (its recomputation included).

    Raises:
        ValueError: a negative cost.
    """

    block_s: float
    """One block's forward and backward, the mean over the model's blocks (their kinds kept:
    DeepSeek-V3's dense first blocks, gpt-oss's alternating attention)."""
    head_s: float
    """The final norm, the output head and the loss, forward and backward."""
    embedding_s: float
    """The token embedding, forward and backward."""
    update_s_per_param: float
    """Gradient norm, clipping and the optimizer step, per parameter a device updates."""
    fsdp_copy_s_per_byte: float = 0.0
    """FSDP2's copies through its flat buffers (the all-gather's copy-in and copy-out, the
    reduce-scatter's chunk-cat), seconds per byte its collectives move (`comm_model.Comm.bytes`):
    per collective call, not per sequence."""
    source: str = ""
    """What was priced (device, run), for `--explain`."""

    def __post_init__(self) -> None:
        for name in ("block_s", "head_s", "embedding_s", "update_s_per_param",
                     "fsdp_copy_s_per_byte"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"ComputeCosts.{name}={getattr(self, name)} must be >= 0")

    def sequence_s(self, blocks: int, has_head: bool, has_embedding: bool) -> float:
        """One sequence through `blocks` blocks, the head and the embedding where held."""
        return self.block_s * blocks + self.head_s * has_head + self.embedding_s * has_embedding
