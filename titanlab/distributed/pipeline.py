"""Pipeline parallel: split the model into stages by layer or by cost and run a
`torch.distributed.pipelining` schedule over them.

Stages hold whole transformer blocks; the first stage also holds the token embedding, the last
the final norm and output projection (and any multi-token prediction depths). Each rank holds
one stage (GPipe, 1F1B), several stages placed round-robin (Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble; Narayanan et al. 2021, Qi et al. 2023) or two stages in a V
(ZBVZeroBubble, DualPipeV; rank r holds stages r and 2·pp−1−r; Qi et al. 2024, DeepSeek-V3
report).
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S

from titanlab.config.job_config import ConfigError
from titanlab.distributed import moe_stats, qk_clip
from titanlab.peft.qlora import to_empty_keeping_quantized

if TYPE_CHECKING:
    from titanlab.models.common.decoder import Decoder

logger = logging.getLogger("titanlab")

SINGLE = {"GPipe": S.ScheduleGPipe, "1F1B": S.Schedule1F1B}
LOOPED = {
    "Interleaved1F1B": S.ScheduleInterleaved1F1B,
    "LoopedBFS": S.ScheduleLoopedBFS,
    "InterleavedZeroBubble": S.ScheduleInterleavedZeroBubble,
}
V_SHAPE = {"ZBVZeroBubble": S.ScheduleZBVZeroBubble, "DualPipeV": S.ScheduleDualPipeV}
ZERO_BUBBLE = {"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}


class _Stage(PipelineStage):
    """A `PipelineStage` whose shape-inference pass (torch 2.13 runs one real forward and
    backward per stage before the first step) leaves the MoE layers' load statistics and the
    multi-token prediction loss's running sum and QK-clip's logit maxima alone: counted, they
    would skew step 1's expert-bias update, aux loss, logged MTP loss and clipping (its inputs
    are uninitialized memory)."""

    def _forward_metadata_inference(self, *args, **kwargs):
        mtp_loss = getattr(self.submod, "last_mtp_loss", None)
        try:
            with moe_stats.stats_paused(self.submod), qk_clip.records_paused(self.submod):
                return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            if hasattr(self.submod, "last_mtp_loss"):
                self.submod.last_mtp_loss = mtp_loss

    def _backward_metadata_inference(self, *args, **kwargs):
        with moe_stats.stats_paused(self.submod), qk_clip.records_paused(self.submod):
            return super()._backward_metadata_inference(*args, **kwargs)


def stages_per_rank(schedule: str, looped_stages_per_rank: int) -> int:
    """1 for single-stage schedules, 2 for V schedules, the configured count for looped ones."""
    if schedule in SINGLE:
        return 1
    if schedule in V_SHAPE:
        return 2
    return looped_stages_per_rank


def stage_ids(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """Indices of the stages `pp_rank` holds, in execution order."""
    if schedule in V_SHAPE:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def layers_per_stage(n_layers: int, n_stages: int, per_stage: int = -1) -> list[int]:
    """How many transformer blocks each stage holds.

    Auto (-1): the embedding and the output each count as one block of work, and the work is
    spread evenly (any remainder to the middle stages), so the first and last stages hold fewer
    blocks; when that would leave a stage empty, the blocks alone are spread evenly. `per_stage` = N: N blocks per stage, N-1 on the first and last.
    Raises ConfigError when the split leaves a middle stage empty or does not add up.
    """
    if per_stage > 0:
        counts = [per_stage] * n_stages
        if n_stages > 1:
            counts[0] -= 1
            counts[-1] -= 1
        if sum(counts) != n_layers:
            raise ConfigError(
                f"parallelism.pipeline_parallel_layers_per_stage={per_stage} over {n_stages} stages "
                f"gives {sum(counts)} layers (first/last one fewer), but the model has {n_layers}"
            )
        return counts
    if n_stages > n_layers:
        raise ConfigError(
            f"{n_stages} pipeline stages need at least as many layers; the model has {n_layers}"
        )
    units = n_layers + 2 if n_stages > 1 else n_layers
    base, rem = divmod(units, n_stages)
    counts = [base] * n_stages
    middle_first = list(range(1, n_stages - 1)) + [0, n_stages - 1]
    for i in middle_first[:rem]:
        counts[i] += 1
    if n_stages > 1:
        counts[0] -= 1
        counts[-1] -= 1
    if min(counts) < 1:  # too few layers to lighten the ends: one even split of the blocks
        base, rem = divmod(n_layers, n_stages)
        counts = [base + (1 if i in middle_first[:rem] else 0) for i in range(n_stages)]
    return counts


def stage_fqns(
    n_layers: int,
    n_stages: int,
    per_stage: int = -1,
    manual: list[str] | None = None,
    counts: list[int] | None = None,
) -> list[list[str]]:
    """Module names of each stage: manual lists ("tok_embeddings layers.0 ..."), else `counts`
    blocks per stage (a cost-balanced split: `pipeline_split.balanced_counts`), else the layer
    split (`layers_per_stage`)."""
    if manual:
        if len(manual) != n_stages:
            raise ConfigError(
                f"parallelism.pipeline_parallel_module_fqns_per_stage has {len(manual)}"
                f" entries; the schedule needs {n_stages} stages"
            )
        stages = [entry.split() for entry in manual]
        _check_manual_split(stages, n_layers)
        return stages
    fqns, start = [], 0
    for i, count in enumerate(counts or layers_per_stage(n_layers, n_stages, per_stage)):
        names = [f"layers.{j}" for j in range(start, start + count)]
        start += count
        if i == 0:
            names.insert(0, "tok_embeddings")
        if i == n_stages - 1:
            names += ["norm", "output"]
        fqns.append(names)
    return fqns


def _check_manual_split(stages: list[list[str]], n_layers: int) -> None:
    """ConfigError (one line) unless `stages` hold every unit of the model (tok_embeddings,
    layers.0 .. layers.{n_layers-1}, norm, output) once, in model order, none empty."""
    units = ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output"]
    names = [n for stage in stages for n in stage]
    option = "parallelism.pipeline_parallel_module_fqns_per_stage"
    unknown = [n for n in names if n not in units]
    repeated = sorted({n for n in names if names.count(n) > 1}, key=units.index)
    missing = [u for u in units if u not in names]
    if unknown:
        raise ConfigError(
            f"{option} names {unknown}, not modules of the model; its units are tok_embeddings, "
            f"layers.0 .. layers.{n_layers - 1}, norm, output"
        )
    if repeated:
        raise ConfigError(f"{option} puts {repeated} in more than one place; list each once")
    if missing:
        raise ConfigError(f"{option} misses {missing}; every unit must be in one stage")
    if any(not stage for stage in stages):
        raise ConfigError(f"{option} has an empty stage; give each stage a module")
    if names != units:
        raise ConfigError(
            f"{option} lists the modules out of the model's order ({' '.join(names)}); each "
            "stage takes the next modules in order"
        )


def split_counts(model: Decoder, config, n_stages: int) -> list[int] | None:
    """Blocks per stage of a cost-balanced split (`parallelism.pipeline_parallel_split` params
    or flops), logged with each stage's parameters and FLOPs share; None for the layer split."""
    from titanlab.distributed import pipeline_split as ps

    by = config.parallelism.pipeline_parallel_split
    if by == "layers":
        return None
    costs = {
        k: ps.unit_costs(model, model.args, config.training.seq_len, k) for k in ("params", "flops")
    }
    counts = ps.balanced_counts(costs[by], n_stages)
    even = layers_per_stage(len(model.layers), n_stages)
    fqns = stage_fqns(len(model.layers), n_stages, counts=counts)
    logger.info(ps.describe(fqns, costs, by, counts, even))
    return counts


def all_stage_fqns(model: Decoder, config, pp: int) -> list[list[str]]:
    """Module names of every stage of `model` (meta device is enough) over `pp` pipeline ranks:
    the schedule's stages per rank, split as the config says (manual, by layers or by cost)."""
    p = config.parallelism
    n_stages = pp * stages_per_rank(
        p.pipeline_parallel_schedule, p.pipeline_parallel_stages_per_rank
    )
    return stage_fqns(
        len(model.layers),
        n_stages,
        p.pipeline_parallel_layers_per_stage,
        p.pipeline_parallel_module_fqns_per_stage,
        split_counts(model, config, n_stages),
    )


def build_stage_module(model: Decoder, fqns: list[str]) -> Decoder:
    """A copy of `model` (on the meta device) keeping only the modules named in `fqns`; the
    multi-token prediction depths (DeepSeek-V3's `mtp`) go with the output head, whose input
    they extend (the stage boundaries then carry their embeddings: `common/mtp.py`)."""
    stage = copy.deepcopy(model)
    keep = set(fqns)
    for name in ("tok_embeddings", "norm", "output"):
        if name not in keep:
            setattr(stage, name, None)
    if "output" not in keep and getattr(stage, "mtp", None) is not None:
        stage.mtp = None
    for layer_id in list(stage.layers.keys()):
        if f"layers.{layer_id}" not in keep:
            del stage.layers[layer_id]
    unknown = keep - {"tok_embeddings", "norm", "output"} - {f"layers.{i}" for i in model.layers}
    if unknown:
        raise ConfigError(
            f"unknown module names for a pipeline stage: {sorted(unknown)}; valid: "
            "tok_embeddings, layers.<i>, norm, output"
        )
    return stage


def build_schedule(name: str, stages: list[PipelineStage], n_microbatches: int, loss_fn):
    """The schedule object; gradients are not rescaled (the loss is already globally normalized)."""
    if name in SINGLE:
        return SINGLE[name](
            stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False
        )
    cls = LOOPED.get(name) or V_SHAPE[name]
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def pipeline_model(model: Decoder, parallel_dims, config, device, parallelize_fn, loss_fn):
    """Split the meta-device `model` into this rank's stages, parallelize each with
    `parallelize_fn(stage_module)` (TP/AC/compile/FSDP inside the stage), materialize them on
    `device` and build the schedule.

    Returns (schedule, model_parts, has_first_stage, has_last_stage).
    """
    p = config.parallelism
    pp_mesh = parallel_dims.mesh("pp")
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    per_rank = stages_per_rank(p.pipeline_parallel_schedule, p.pipeline_parallel_stages_per_rank)
    n_stages = pp * per_rank
    all_fqns = all_stage_fqns(model, config, pp)
    ids = stage_ids(p.pipeline_parallel_schedule, pp_rank, pp, per_rank)
    parts: list = []
    stages: list[PipelineStage] = []
    for sid in ids:
        part = build_stage_module(model, all_fqns[sid])
        parallelize_fn(part)
        to_empty_keeping_quantized(part, device)  # QLoRA's NF4 base weights are real already
        parts.append(part)
        stages.append(_Stage(part, sid, n_stages, device, group=pp_mesh.get_group()))
    n_mb = config.training.local_batch_size // p.pipeline_parallel_microbatch_size
    schedule = build_schedule(p.pipeline_parallel_schedule, stages, n_mb, loss_fn)
    return schedule, parts, 0 in ids, n_stages - 1 in ids
