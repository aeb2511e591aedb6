"""Building the ledger of a config: the trainer of a dry run at the config's world size, built
and stepped on the target GPU's code path (`titanlab.config.device_path`), its ops recorded
and priced."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from titanlab.config.device_path import Target, code_path_of
from titanlab.config.manager import build_config
from titanlab.ledger.price import Priced, price
from titanlab.ledger.record import OpRecord
from titanlab.ledger.step import group_dims, record_step
from titanlab.planning.cluster import Cluster, get_profile

if TYPE_CHECKING:
    from titanlab.config.job_config import JobConfig
    from titanlab.trainer import Trainer


@dataclass
class Ledger:
    """A priced step: the ops, their prices, the device, and what the step trains."""

    ops: list[OpRecord]
    priced: Priced
    device: Cluster
    tokens: int
    """Tokens rank 0 trains on in the step (local batch × seq_len × accumulation steps)."""
    model_flops: float
    """Training FLOPs of those tokens by the model's count (`flops_per_token`, 6N + attention),
    what MFU is measured against."""
    config_summary: str
    memory_peak: float
    """The pre-flight estimate of the peak rank's memory, bytes."""
    seq_len: int = 0
    """Tokens per sequence (`training.seq_len`)."""
    cp: int = 1
    """Context-parallel degree: each rank holds seq_len / cp of a sequence's queries."""
    group_dims: dict[str, str] = field(default_factory=dict)
    """Process-group name → mesh dim name (`titanlab.ledger.step.group_dims`)."""
    compiled_blocks: bool = False
    """Whether the config compiles the transformer blocks (`compile.enable`, components
    "model")."""


def overlaps_in_graph(config: JobConfig, trainer: Trainer) -> bool:
    """Whether the run's compiled blocks overlap their collectives (what `parallelize_model`
    asks of `apply_compile`: an MoE layer compiled, whole or in pieces, with the exchange in
    chunks), so that the step is priced in the order Inductor gives
    (`price.in_graph_schedule`)."""
    from titanlab.distributed.compile import moe_compile_mode
    from titanlab.distributed.parallelize import param_dtype

    compiled = config.compile.enable and "model" in config.compile.components
    dims, device = trainer.parallel_dims, trainer.device
    moe = moe_compile_mode(config, dims, device, param_dtype(config, device))
    return compiled and moe != "eager" and config.parallelism.expert_dispatch_chunks > 1


def build_ledger(argv: list[str], device: str = "") -> Ledger:
    """The ledger of the run `argv` (a command line of `titanlab.train`) on `device` (a cluster
    profile name or file; default the config's `comm.dry_run_device`). Raises ConfigError (one
    line) for a bad option, profile or a pipelined layout."""
    from titanlab.distributed.init import destroy_distributed
    from titanlab.trainer import Trainer

    extra = ["--comm.mode", "fake_backend", "--comm.dry_run_step", "false"]
    if device:
        extra += ["--comm.dry_run_device", device]
    config = build_config([*argv, *extra])
    profile = get_profile(config.comm.dry_run_device)
    target = Target(profile.device_type, profile.compute_capability)
    with code_path_of(target):
        try:
            trainer = Trainer(config)
            ops = record_step(trainer)
            dims = group_dims(trainer)
            in_graph = overlaps_in_graph(config, trainer)
        finally:
            destroy_distributed(barrier=False)
    t = config.training
    tokens = t.local_batch_size * t.seq_len * trainer.batch.grad_accum_steps
    per_token = trainer.flops_per_token
    dp = trainer.parallel_dims
    summary = (
        f"{config.model.name} {config.model.flavor}, seq_len {t.seq_len}, local batch "
        f"{t.local_batch_size} × {trainer.batch.grad_accum_steps} accumulation step(s), "
        f"{dp}, compile {'on' if config.compile.enable else 'off'}"
    )
    # the model's FLOPs per rank: its share of the tensor-parallel (and context-parallel) work
    model_flops = per_token * tokens / (dp.tp * dp.cp)
    priced = price(ops, profile, dims, in_graph_overlap=in_graph)
    peak = trainer.memory.total if trainer.memory is not None else 0.0
    compiled = config.compile.enable and "model" in config.compile.components
    return Ledger(ops, priced, profile, tokens, model_flops, summary, peak, t.seq_len, dp.cp,
                  dims, compiled)  # fmt: skip
