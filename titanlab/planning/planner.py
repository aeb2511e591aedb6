"""Rank the parallel layouts of a cluster for one training job: every candidate the trainer's
validator accepts, with the pre-flight's memory estimate and the performance model's step time
(`titanlab.planning.perf_model`). `python -m titanlab.plan` prints the result.

Candidates: tp a power of two within a node, cp (sequences of 32k tokens or more) within a node,
pp a power of two up to the number of blocks, each split of the remaining data-parallel ranks
into dp_replicate × dp_shard, each pipeline schedule, ZeRO stages 2 and 3 where ranks shard,
expert parallel (MoE models) each power of two up to the experts and the borrowable ranks; one
sample per pipeline microbatch, no gradient accumulation beyond what the batch needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.planning.cluster import Cluster
from titanlab.planning.layouts import SCHEDULES, Layout, apply_layout, check_layout
from titanlab.planning.memory import MemoryEstimate, estimate_memory
from titanlab.planning.perf_model import ModelShape, Prediction, Run, predict


@dataclass
class Candidate:
    """One layout: its prediction, its memory estimate, and why it cannot run (or None)."""

    layout: Layout
    prediction: Prediction | None = None
    memory: MemoryEstimate | None = None
    refused: str | None = None

    @property
    def fits(self) -> bool:
        return self.refused is None


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(world: int, cluster: Cluster, shape: ModelShape, run: Run) -> list[Layout]:
    """The layouts searched (see the module docstring), before validation."""
    node = cluster.devices_per_node
    cps = _powers_of_two(node) if run.seq_len >= 32768 else [1]
    out = []
    for tp in _powers_of_two(min(node, world)):
        for cp in cps:
            for pp in _powers_of_two(min(shape.n_layers, world)):
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                for shard in _divisors(dp):
                    rep = dp // shard
                    if run.global_batch % dp:
                        continue
                    sharded = shard * cp > 1
                    for stage in (3, 2) if sharded else (3,):
                        for schedule in SCHEDULES if pp > 1 else (None,):
                            for ep in _expert_degrees(shape, shard * cp * tp):
                                out.append(Layout(rep, shard, tp, pp, schedule, 1, cp, ep,
                                                  zero_stage=stage))  # fmt: skip
    return out


def _expert_degrees(shape: ModelShape, borrowable: int) -> list[int]:
    if not shape.num_experts:
        return [1]
    return [e for e in _powers_of_two(min(shape.num_experts, borrowable)) if borrowable % e == 0]


def plan(
    config: JobConfig, model_args, cluster: Cluster, run: Run | None = None
) -> list[Candidate]:
    """Every candidate layout of `cluster` for `config`'s model, seq_len and global batch:
    fitting ones first, fastest predicted step first; then those refused (validator or
    memory), each with its one-line reason. ConfigError when none fits."""
    run = run or run_of(config)
    shape = ModelShape.of(model_args)
    dtype = getattr(torch, run.dtype if run.dtype != "float8" else "bfloat16")
    out = []
    for lay in candidate_layouts(cluster.world_size, cluster, shape, run):
        cand = Candidate(lay)
        why = check_layout(config, lay, run.global_batch, model_args, "cuda")
        if why is not None:
            cand.refused = why
        else:
            cfg = apply_layout(config, lay, run.global_batch)
            cand.memory = estimate_memory(model_args, cfg, lay.world_size, dtype)
            cand.prediction = predict(shape, run, lay, cluster)
            if cand.memory.total > cluster.memory_bytes:
                cand.refused = (
                    f"needs {cand.memory.total / 2**30:.1f} GiB per device "
                    f"({cand.memory.summary()}), the device has "
                    f"{cluster.memory_bytes / 2**30:.1f} GiB"
                )
        out.append(cand)
    fitting = sorted((c for c in out if c.fits), key=lambda c: c.prediction.step_s)  # type: ignore[union-attr]
    if not fitting:
        raise ConfigError(
            f"no layout of {cluster.world_size} {cluster.name} devices holds "
            f"model.flavor={config.model.flavor} at training.seq_len={run.seq_len} and "
            f"global_batch_size={run.global_batch}; use more nodes, a smaller batch or seq_len"
        )
    return fitting + [c for c in out if not c.fits]


def model_args_of(config: JobConfig):
    """The model's args as the trainer builds them (`build_model_args`), with the published
    flavor's vocabulary (the real run's, whatever tokenizer this machine has), or the
    tokenizer's where the flavor has none (the debug models)."""
    from titanlab.components import builders as components
    from titanlab.models.registry import get_flavor

    family = components.build_family(config)
    try:
        vocab = get_flavor(family, config.model.flavor).vocab_size
    except ValueError:  # not a published flavor (model.flavor = "hf": an imported one)
        vocab = 0
    if vocab <= 0:
        vocab = components.build_tokenizer(config).vocab_size
    return components.build_model_args(config, vocab)


def run_of(config: JobConfig) -> Run:
    """The layout-independent work of `config`'s optimizer step."""
    t, ac = config.training, config.activation_checkpoint
    if ac.mode == "selective":
        mode = f"selective_{ac.selective_ac_option}"
    else:
        mode = ac.mode
    if t.global_batch_size < 1:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size}: the planner needs the samples "
            "per optimizer step; set it (e.g. --training.global_batch_size 512)"
        )
    param_bytes = 4 if t.mixed_precision_param == "float32" else 2
    dtype = "float8" if config.float8.enable else t.mixed_precision_param
    return Run(
        seq_len=t.seq_len,
        global_batch=t.global_batch_size,
        ac_mode=mode,
        param_bytes=param_bytes,
        grad_bytes=4 if t.mixed_precision_reduce == "float32" else 2,
        dtype=dtype,
        pp_microbatch_size=config.parallelism.pipeline_parallel_microbatch_size,
    )
