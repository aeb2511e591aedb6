"""Rank the parallel layouts of a cluster for one training job: every candidate the trainer's
validator accepts, with the pre-flight's memory estimate and the performance model's step time
(`titanlab.planning.perf_model`). `python -m titanlab.plan` prints the result.

Candidates: tp a power of two within a node, cp (sequences of 32k tokens or more) within a node,
pp a power of two up to the number of blocks, each split of the remaining data-parallel ranks
into dp_replicate × dp_shard, each pipeline schedule, ZeRO stages 2 and 3 where ranks shard,
expert parallel (MoE models) each power of two up to the experts and the borrowable ranks; one
sample per pipeline microbatch (`parallelism.pipeline_parallel_microbatch_size`); for each, the
activation checkpointing (none, selective op, full) and the fewest gradient-accumulation steps
(a power of two) whose memory fits and whose predicted step is the fastest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.config.performance import ActivationCheckpoint
from titanlab.planning.cluster import Cluster
from titanlab.planning.compute_costs import ComputeCosts
from titanlab.planning.layouts import Layout, apply_layout, check_layout, enumerate_layouts
from titanlab.planning.memory import GIB, MemoryEstimate, estimate_memory
from titanlab.planning.perf_model import ModelShape, Prediction, Run, predict


@dataclass
class Candidate:
    """One layout: its prediction, its memory estimate, and why it cannot run (or None)."""

    layout: Layout
    prediction: Prediction | None = None
    memory: MemoryEstimate | None = None
    refused: str | None = None
    ac_mode: str = ""
    """The activation checkpointing of the prediction (none, selective_op, full)."""
    config: JobConfig | None = None
    """The job with this layout and AC mode: what `--apply` writes."""

    @property
    def step_s(self) -> float:
        """The predicted step in seconds (infinite for a layout that cannot run)."""
        return self.prediction.step_s if self.prediction is not None else float("inf")

    @property
    def fits(self) -> bool:
        """Whether the layout runs: the validator accepts it and its estimate fits the device."""
        return self.refused is None


AC_MODES = (
    ("none", ActivationCheckpoint("none")),
    ("selective_op", ActivationCheckpoint("selective", "op")),
    ("full", ActivationCheckpoint("full")),
)
"""The activation checkpointing the planner tries: the performance model's name, the config."""


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def candidate_layouts(world: int, cluster: Cluster, shape: ModelShape, run: Run) -> list[Layout]:
    """The layouts searched (see the module docstring), before validation: those of
    `enumerate_layouts` (the generated layout matrix's enumeration) that the rules keep."""
    node = cluster.devices_per_node
    long_context = run.seq_len >= 32768
    out = []
    for lay in enumerate_layouts(
        world,
        with_cp=long_context,
        grad_accum=(1,),
        with_ep=shape.num_experts > 0,
        zero_stages=(3, 2),
    ):
        dp = lay.dp_replicate * lay.dp_shard
        if (
            not all(_power_of_two(n) for n in (lay.tp, lay.pp, lay.cp, lay.ep))
            or lay.tp > node
            or lay.cp > node
            or lay.pp > shape.n_layers
            or lay.ep > max(shape.num_experts, 1)
            or run.global_batch % dp
        ):
            continue
        out.append(lay)
        if lay.cp > 1 and lay.cp_rotate == "allgather" and shape.n_heads % (lay.tp * lay.cp) == 0:
            out.append(dataclasses.replace(lay, cp_rotate="ulysses"))  # Ulysses CP beside ring
    return out


def plan(
    config: JobConfig,
    model_args,
    cluster: Cluster,
    run: Run | None = None,
    search_ac: bool = True,
    costs: Callable[[str, int], ComputeCosts] | None = None,
) -> list[Candidate]:
    """Every candidate layout of `cluster` for `config`'s model, seq_len and global batch, each
    in the AC mode (none, selective op, full; `config`'s own when not `search_ac`) and with the
    fewest accumulation steps that predict the fastest step that fits: fitting ones first,
    fastest first; then those refused (validator or memory), each with its one-line reason.
    `costs(ac_mode, ep)` gives the ledger's compute costs of an AC mode and expert-parallel
    degree (`perf_model.predict`); None: the FLOP model's. ConfigError when none fits."""
    run = run or run_of(config, cluster.device_type, global_batch_of(config, cluster.world_size)[0])
    shape = ModelShape.of(model_args)
    dtype = getattr(torch, run.dtype if run.dtype != "float8" else "bfloat16")
    modes = AC_MODES if search_ac else ((run.ac_mode, config.activation_checkpoint),)
    out = []
    for lay in candidate_layouts(cluster.world_size, cluster, shape, run):
        best: Candidate | None = None
        for ac_mode, ac in modes:
            # A new top level and AC section; the sections no candidate changes are shared
            # (`apply_layout` replaces those it sets), where a deep copy per candidate took
            # most of a 3,000-candidate search.
            cfg = dataclasses.replace(config, activation_checkpoint=dataclasses.replace(
                config.activation_checkpoint, mode=ac.mode,
                selective_ac_option=ac.selective_ac_option))  # fmt: skip
            mode_costs = costs(ac_mode, lay.ep) if costs is not None else None
            cand = _fewest_microbatches(cfg, model_args, shape, dataclasses.replace(
                run, ac_mode=ac_mode), lay, cluster, dtype, mode_costs)  # fmt: skip
            if cand.memory is None:  # the validator's refusal: the same in every AC mode
                best = cand
                break
            if best is None or (cand.fits and (not best.fits or cand.step_s < best.step_s)):
                best = cand
        assert best is not None
        out.append(best)
    fitting = sorted((c for c in out if c.fits), key=lambda c: c.step_s)
    if not fitting:
        raise ConfigError(
            f"no layout of {cluster.world_size} {cluster.name} devices holds "
            f"model.flavor={config.model.flavor} at training.seq_len={run.seq_len} and "
            f"global_batch_size={run.global_batch}; use more nodes, a smaller batch or seq_len"
        )
    return fitting + [c for c in out if not c.fits]


def _fewest_microbatches(
    config, model_args, shape, run, lay, cluster, dtype, costs=None
) -> Candidate:
    """`lay` with the fewest gradient-accumulation steps whose memory fits (more only add FSDP
    traffic and smaller GEMMs); the last one tried when none fits."""
    dp = lay.dp_replicate * lay.dp_shard
    for accum in (a for a in _powers(run.global_batch // dp) if run.global_batch % (dp * a) == 0):
        lay_a = dataclasses.replace(lay, grad_accum=accum)
        cand = _evaluate(config, model_args, shape, run, lay_a, cluster, dtype, costs)
        if cand.fits or cand.memory is None:
            break
    return cand


def _powers(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit`."""
    return [2**k for k in range(max(limit, 1).bit_length()) if 2**k <= limit]


def _evaluate(config, model_args, shape, run, lay, cluster, dtype, costs=None) -> Candidate:
    """`lay` validated, its memory estimated and its step predicted."""
    cand = Candidate(lay)
    why = check_layout(config, lay, run.global_batch, model_args, cluster.device_type)
    if why is not None:
        cand.refused = why
        return cand
    cfg = apply_layout(config, lay, run.global_batch)
    cand.config, cand.ac_mode = cfg, run.ac_mode
    cand.memory = estimate_memory(
        model_args, cfg, lay.world_size, dtype, device_type=cluster.device_type
    )
    cand.prediction = predict(shape, run, lay, cluster, costs)
    if cand.memory.total > cluster.memory_bytes:
        cand.refused = (
            f"needs {cand.memory.total / GIB:.1f} GiB per device ({cand.memory.summary()}), "
            f"the device has {cluster.memory_bytes / GIB:.1f} GiB"
        )
    return cand


def layout_of(config: JobConfig, world_size: int, grad_accum: int) -> Layout:
    """The layout `config` runs on `world_size` ranks (the degrees `ParallelDims` resolves)."""
    from titanlab.distributed.parallel_dims import ParallelDims

    p = config.parallelism
    dims = ParallelDims.from_config(p, world_size)
    return Layout(dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp,
                  p.pipeline_parallel_schedule if dims.pp > 1 else None, grad_accum, dims.cp,
                  p.expert_parallel_degree, zero_stage=p.zero_stage_in_force)  # fmt: skip


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


def global_batch_of(config: JobConfig, world_size: int) -> tuple[int, str]:
    """The samples per optimizer step the planner holds fixed over every layout of `world_size`
    devices, and how it was found ("" when the config sets it).

    `training.global_batch_size` when set. At -1 the trainer makes it local_batch_size × the
    data-parallel degree of its layout (`components.builders.batch_layout`), which varies over the
    planner's layouts; the planner takes the one of the config's own `[parallelism]` on
    `world_size` devices (`ParallelDims`: dp_shard -1 takes the ranks tp, cp and pp leave), the
    batch the config runs at when launched as it is, and compares every layout at it.

    Raises:
        ConfigError: -1 with degrees that do not lay out on `world_size` devices.
    """
    from titanlab.distributed.parallel_dims import ParallelDims

    t = config.training
    if t.global_batch_size != -1:
        return t.global_batch_size, ""
    try:
        dp = ParallelDims.from_config(config.parallelism, world_size).dp_degree
    except ConfigError as e:
        raise ConfigError(
            f"training.global_batch_size=-1 means local_batch_size × the data-parallel ranks of "
            f"the config's own layout, which does not fit {world_size} devices ({e}); set "
            "--training.global_batch_size"
        ) from None
    how = (
        f" (global_batch_size -1: local_batch_size {t.local_batch_size} × dp {dp}, the "
        f"config's own layout on {world_size} devices)"
    )
    return t.local_batch_size * dp, how


def run_of(config: JobConfig, device_type: str = "cuda", global_batch: int = 0) -> Run:
    """The layout-independent work of `config`'s optimizer step on `device_type` (CPU computes
    in float32 unless `training.mixed_precision_on_cpu`); `global_batch` > 0 replaces
    `training.global_batch_size` (a resolved -1). ConfigError when neither is set."""
    t, ac = config.training, config.activation_checkpoint
    if ac.mode == "selective":
        mode = f"selective_{ac.selective_ac_option}"
    else:
        mode = ac.mode
    global_batch = global_batch or t.global_batch_size
    if global_batch < 1:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size}: the planner needs the samples "
            "per optimizer step; set it (e.g. --training.global_batch_size 512)"
        )
    fp32 = t.mixed_precision_param == "float32" or (
        device_type == "cpu" and not t.mixed_precision_on_cpu
    )
    param_bytes = 4 if fp32 else 2
    dtype = "float8" if config.float8.enable else "float32" if fp32 else t.mixed_precision_param
    return Run(
        seq_len=t.seq_len,
        global_batch=global_batch,
        ac_mode=mode,
        param_bytes=param_bytes,
        grad_bytes=4 if t.mixed_precision_reduce == "float32" else 2,
        dtype=dtype,
        pp_microbatch_size=config.parallelism.pipeline_parallel_microbatch_size,
        looped_stages_per_rank=config.parallelism.pipeline_parallel_stages_per_rank,
        layers_per_stage=config.parallelism.pipeline_parallel_layers_per_stage,
        fsdp_reshard_after_forward=config.parallelism.fsdp_reshard_after_forward,
        optimizer=config.optimizer.name,
        muon_ns_steps=config.optimizer.muon_ns_steps,
        muon_ns_dtype=config.optimizer.muon_ns_dtype,
    )
