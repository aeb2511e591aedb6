"""What the pre-flight's memory estimate holds: bytes per rank by category, and their peak
(`titanlab.planning.memory.estimate_memory` fills it)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30

CATEGORIES = (
    "params",
    "grads",
    "optimizer",
    "gathered_params",
    "activations",
    "a2a_buffers",
    "pipeline_buffers",
    "logits",
    "overhead",
)
"""The estimate's byte categories, in the order reports list them."""


@dataclass
class MemoryEstimate:
    """Estimated bytes per rank, by category."""

    params: int
    grads: int
    optimizer: int
    gathered_params: int
    activations: int
    logits: int
    overhead: int
    a2a_buffers: int = 0
    recompute: int = 0  # one block's activations, recomputed in backward under full/per-layer AC
    grads_during_forward: bool = False  # gradient accumulation keeps them through forwards
    last_block: int = 0  # the first block's activations, alive while its backward runs
    pipeline_buffers: int = 0  # a pipeline stage's receive buffers, one per microbatch

    @property
    def peak_tensors(self) -> int:
        """Peak bytes of tensors: at the start of backward, at its end (every gradient but the
        first block's made, that block's activations alive: the peak where checkpointing or the
        fused loss leave little at the start), or at the optimizer step."""
        # The logits' gradients are freed before the last block is recomputed: never both at once.
        backward = (
            self.activations
            + self.a2a_buffers
            + self.pipeline_buffers
            + max(self.logits, self.recompute)
            + (self.grads if self.grads_during_forward else 0)
        )
        end = self.grads + self.last_block
        return self.params + self.optimizer + self.gathered_params + max(backward, end)

    @property
    def total(self) -> int:
        return self.peak_tensors + self.overhead

    def peak_parts(self) -> list[tuple[str, int]]:
        """(name, bytes) of what is alive at the peak (`peak_tensors`), plus the overhead: they
        sum to `total`. At the start of backward: the activations, buffers, the larger of the
        logits and one block's recomputation, and gradients kept through forward; at its end:
        the gradients and the first block's activations."""
        parts = [("params", self.params), ("optimizer", self.optimizer),
                 ("gathered_params", self.gathered_params)]  # fmt: skip
        start = (self.activations + self.a2a_buffers + self.pipeline_buffers
                 + max(self.logits, self.recompute)
                 + (self.grads if self.grads_during_forward else 0))  # fmt: skip
        if start >= self.grads + self.last_block:
            parts += [("activations", self.activations), ("a2a_buffers", self.a2a_buffers),
                      ("pipeline_buffers", self.pipeline_buffers)]  # fmt: skip
            if self.recompute > self.logits:
                parts.append(("recomputed block", self.recompute))
            else:
                parts.append(("logits", self.logits))
            if self.grads_during_forward:
                parts.append(("grads", self.grads))
        else:
            parts += [("grads", self.grads), ("first block's activations", self.last_block)]
        return [*parts, ("overhead", self.overhead)]

    def summary(self) -> str:
        """The peak's parts (`peak_parts`) in GiB, e.g. "params 3.7, ..., overhead 1.0 GiB":
        they add up to `total`."""
        return ", ".join(f"{n} {b / GIB:.1f}" for n, b in self.peak_parts() if b) + " GiB"


def shrinking_option(est: MemoryEstimate, config) -> str:
    """The estimate's largest category and the option that shrinks it, for a refusal that does
    not send a user to more devices when more devices would not help (`config` a JobConfig):
    e.g. "activations 65.1 GiB are the largest part: --activation_checkpoint.mode full
    recomputes them in backward"."""
    sizes = {name: b for name, b in est.peak_parts() if name != "overhead"}
    largest = max(sizes, key=lambda name: sizes[name])
    ac = config.activation_checkpoint.mode
    remedies = {
        "params": "more devices in dp_shard (FSDP shards them)",
        "grads": "more devices in dp_shard (FSDP shards them)",
        "optimizer": "more devices in dp_shard (FSDP shards the moments)",
        "gathered_params": "--parallelism.fsdp_reshard_after_forward always frees them "
        "after each forward",
        "activations": "--activation_checkpoint.mode full recomputes them in backward"
        if ac != "full"
        else "a smaller --training.local_batch_size or seq_len, or context parallel "
        "(--parallelism.context_parallel_degree) splits the sequence",
        "a2a_buffers": "a smaller --training.local_batch_size (the experts' all-to-all "
        "buffers grow with the tokens of a microbatch, not with the devices)",
        "pipeline_buffers": "fewer microbatches in flight "
        "(--parallelism.pipeline_parallel_microbatch_size larger)",
        "logits": "--loss.fused_linear_cross_entropy true computes them chunk by chunk",
        "recomputed block": "a smaller --training.local_batch_size or seq_len, or context "
        "parallel (--parallelism.context_parallel_degree) splits the sequence (one block's "
        "activations, recomputed in backward, are held at once)",
        "first block's activations": "--activation_checkpoint.mode full recomputes them in "
        "backward",
    }
    return f"{largest} {sizes[largest] / GIB:.1f} GiB are the largest part: {remedies[largest]}"
