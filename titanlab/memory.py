"""Pre-flight memory estimate: will this config fit on the devices it is about to run on?

Per-rank bytes, estimated from the model dims and the layout (no tensors are allocated):
- parameters (fp32 master weights), gradients (fp32) and AdamW state (two fp32 moments), each
  divided by the number of ranks that shard them (dp_shard × cp × tp × pp);
- under FSDP, the gathered parameters of the two blocks in flight (current + prefetched) in
  the compute dtype;
- activations of one microbatch: per layer ≈ s·b·h·34 bytes at 2 bytes/element without AC
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Table 2, with flash attention so the 5·a·s/h term vanishes), scaled by the element size; full
  AC keeps only each block's input (2·s·b·h) plus one block's activations; op-level selective AC
  keeps about half;
- logits and their gradient in fp32 (2 × b·s·vocab × 4 bytes);
- a fixed runtime overhead (CUDA context and allocator slack on GPU, the interpreter on CPU).

It is a first-order estimate meant to catch hopeless configurations (8B on a laptop) with a
clear message, not to predict the peak to the megabyte.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from titanlab.config.job_config import ConfigError, JobConfig

GIB = 2**30


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

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.gathered_params
                + self.activations + self.logits + self.overhead)

    def summary(self) -> str:
        parts = [(name, getattr(self, name)) for name in
                 ("params", "grads", "optimizer", "gathered_params", "activations", "logits", "overhead")]
        return ", ".join(f"{n} {b / GIB:.1f}" for n, b in parts if b) + " GiB"


def estimate_memory(model_args, config: JobConfig, world_size: int,
                    compute_dtype: torch.dtype) -> MemoryEstimate:
    """Estimate per-rank memory for training `model_args` with `config` on `world_size` ranks.

    Args:
        model_args: a `TransformerModelArgs` with vocab_size set.
        compute_dtype: dtype of activations (the FSDP param dtype, float32 on CPU by default).
    """
    from titanlab.models.llama3 import Transformer, count_params

    with torch.device("meta"):
        model = Transformer(model_args)
    n_params = count_params(model)
    block_params = count_params(model.layers["0"])
    p = config.parallelism
    tp, pp, cp = p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree
    dp_shard = p.data_parallel_shard_degree
    if dp_shard == -1:
        dp_shard = max(world_size // (p.data_parallel_replicate_degree * tp * pp * cp), 1)
    shard = dp_shard * cp * tp * pp
    elem = torch.finfo(compute_dtype).bits // 8

    b, s, h = config.training.local_batch_size, config.training.seq_len, model_args.dim
    s_local = s // cp
    layers = model_args.n_layers // pp
    per_layer = s_local * b * h * 34 * elem // 2 // tp
    mode = config.activation_checkpoint.mode
    if mode == "full":
        acts = layers * s_local * b * h * elem + per_layer
    elif mode == "selective" and config.activation_checkpoint.selective_ac_option == "op":
        acts = layers * per_layer // 2
    elif mode == "selective":
        every = int(config.activation_checkpoint.selective_ac_option)
        kept = layers - layers // every
        acts = kept * per_layer + (layers // every) * s_local * b * h * elem + per_layer
    else:
        acts = layers * per_layer
    on_gpu = torch.cuda.is_available()
    return MemoryEstimate(
        params=4 * n_params // shard,
        grads=4 * n_params // shard,
        optimizer=8 * n_params // shard,
        gathered_params=2 * block_params * elem // tp if dp_shard * cp > 1 else 0,
        activations=acts,
        logits=2 * b * s_local * model_args.vocab_size * 4 // tp,
        overhead=(2 if on_gpu else 1) * GIB // 2,
    )


def available_bytes_per_rank(local_world_size: int) -> tuple[int, str]:
    """(bytes, description) one rank may use: the GPU's total memory, or the host's
    MemAvailable shared by the ranks on this host."""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return total, f"{torch.cuda.get_device_name(0)} with {total / GIB:.1f} GiB"
    avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    per_rank = avail // max(local_world_size, 1)
    return per_rank, (f"{avail / GIB:.1f} GiB of available host memory shared by "
                      f"{local_world_size} CPU process(es), {per_rank / GIB:.1f} GiB each")


def check_memory(model_args, config: JobConfig, world_size: int, local_world_size: int,
                 compute_dtype: torch.dtype) -> MemoryEstimate:
    """Raise ConfigError (one line) when the estimate exceeds what a rank has.

    Skipped (returns the estimate only) when `training.memory_check` is false.
    """
    est = estimate_memory(model_args, config, world_size, compute_dtype)
    if not config.training.memory_check:
        return est
    have, what = available_bytes_per_rank(local_world_size)
    if est.total > have:
        raise ConfigError(
            f"model.flavor={config.model.flavor} needs about {est.total / GIB:.1f} GiB per rank "
            f"({est.summary()}) on {world_size} rank(s), but there is {what}; use more devices, "
            "a smaller model.flavor (e.g. debugmodel) or a smaller batch "
            "(--training.memory_check false skips this check)")
    return est


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
