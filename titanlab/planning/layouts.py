"""Every parallel layout of a world size, and which of them the trainer accepts.

A layout is one choice of degrees (dp_replicate × dp_shard × cp × tp × pp = world size), a
pipeline schedule when pp > 1, and a number of gradient-accumulation steps, for a fixed global
batch. `enumerate_layouts` lists all candidates; `check_layout` asks the same validator the
trainer and the pre-flight check use (`titanlab.planning.validate`) and returns its one-line
refusal or None. The parity matrix (`tools/parity_matrix.py`, `tests/integration/
test_parity_matrix.py`) runs every accepted layout against one process, or the pairwise
subset `titanlab.planning.layout_cover` picks.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.distributed import pipeline
from titanlab.distributed.parallel_dims import ParallelDims
from titanlab.planning.validate import validate_layout, validate_tp_mode

if TYPE_CHECKING:
    from titanlab.config.parallelism import CPRotateMethod, PipelineSchedule, TensorParallelMode

SCHEDULES = (*pipeline.SINGLE, *pipeline.LOOPED, *pipeline.V_SHAPE)
CP_ROTATE_METHODS = ("allgather", "alltoall")


@dataclass(frozen=True)
class Layout:
    """One parallel layout; `global_batch_size` samples per optimizer step in every layout."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    schedule: str | None  # None when pp == 1
    grad_accum: int
    cp: int = 1
    ep: int = 1
    """Expert parallel (MoE models): ranks borrowed from dp_shard × cp × tp, not a factor of
    the world size."""
    cp_rotate: str = "allgather"
    """cp > 1: the ring's `context_parallel_rotate_method`, or "ulysses" (the planner's
    `context_parallel_mode = "ulysses"` candidates)."""
    zero_stage: int = 3
    """`parallelism.zero_stage`: 3 (FSDP2's full sharding) unless the layout is a ZeRO variant;
    stages 0-2 change only what the dp_shard × cp ranks hold, so they are enumerated only where
    there are such ranks."""
    offload: bool = False
    """ZeRO-Offload (`training.enable_cpu_offload`): sharded parameters, gradients and optimizer
    state in host memory."""
    tp_mode: str = "1d"
    """`parallelism.tensor_parallel_mode`: 1d, 2d on a q × q grid of the tp ranks, or 2.5d on
    d >= 2 stacked q × q grids (`tp_depth`)."""
    tp_depth: int = 1
    """`parallelism.tensor_parallel_depth` (2.5d)."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp_kind(self) -> str | None:
        """ddp (replicate only), fsdp (shard only), hsdp (both) or None (one data stream)."""
        rep, shard = self.dp_replicate > 1, self.dp_shard * self.cp > 1
        return {(True, False): "ddp", (False, True): "fsdp", (True, True): "hsdp"}.get((rep, shard))

    @property
    def name(self) -> str:
        """A readable id, e.g. `ws4-ddp2-pp2-1F1B-ga2`."""
        parts = [f"ws{self.world_size}"]
        if self.dp_kind == "hsdp":
            parts.append(f"hsdp{self.dp_replicate}x{self.dp_shard}")
        elif self.dp_kind == "ddp":
            parts.append(f"ddp{self.dp_replicate}")
        elif self.dp_shard > 1:
            parts.append(f"fsdp{self.dp_shard}")
        for label, degree in (("cp", self.cp), ("tp", self.tp), ("ep", self.ep)):
            if degree > 1:
                parts.append(f"{label}{degree}")
                if label == "cp" and self.cp_rotate != "allgather":
                    parts.append(self.cp_rotate)
                if label == "tp" and self.tp_mode != "1d":
                    parts.append(self.tp_mode + (f"x{self.tp_depth}" if self.tp_depth > 1 else ""))
        if self.pp > 1:
            parts.append(f"pp{self.pp}-{self.schedule}")
        if self.grad_accum > 1:
            parts.append(f"ga{self.grad_accum}")
        if self.variants:
            parts.append(f"zero{self.zero_stage}")
        if self.offload:
            parts.append("offload")
        return "-".join(parts)

    @property
    def variants(self) -> frozenset[str]:
        """The ZeRO variant this layout is, as features: `zero0`-`zero2` for a stage other than
        3, `offload` with its stage (`zero3` included); empty for FSDP2's default (stage 3, no
        offload)."""
        if self.zero_stage == 3 and not self.offload:
            return frozenset()
        return frozenset({f"zero{self.zero_stage}"} | ({"offload"} if self.offload else set()))

    @property
    def features(self) -> frozenset[str]:
        """The features this layout exercises, for pairwise coverage."""
        out = set()
        if self.dp_kind:
            out.add(self.dp_kind)
        if self.tp > 1:
            out.add("tp" if self.tp_mode == "1d" else f"tp{self.tp_mode}")
        if self.cp > 1:
            out.add("cp")
        if self.ep > 1:
            out.add("ep")
            if self.ep >= 4:
                out.add("ep4")
            if self.dp_shard * self.cp * self.tp > self.ep:  # experts FSDP-sharded (efsdp > 1)
                out.add("efsdp")
        if self.pp > 1:
            out.add(f"pp:{self.schedule}")
            if self.pp >= 4:
                out.add("pp4")
        if self.grad_accum > 1:
            out.add("grad_accum")
        return frozenset(out) | self.variants

    @property
    def tags(self) -> frozenset[str]:
        """`features` plus the world size (`8ranks`) and CP's rotate method (`cp:alltoall`),
        which `pairwise_subset`'s `must` may ask for but which are not paired with every other
        feature."""
        extra = {"8ranks"} if self.world_size >= 8 else set()
        if self.cp > 1:
            extra.add(f"cp:{self.cp_rotate}")
        return self.features | extra

    def local_batch_size(self, global_batch_size: int) -> int | None:
        """Samples per rank per microbatch step, or None when the global batch does not split."""
        per = self.dp_replicate * self.dp_shard * self.grad_accum
        return global_batch_size // per if global_batch_size % per == 0 else None

    def overrides(self, global_batch_size: int) -> list[str]:
        """Command-line options that select this layout (`--section.key value` pairs)."""
        local = self.local_batch_size(global_batch_size)
        out = [
            "--parallelism.data_parallel_replicate_degree",
            str(self.dp_replicate),
            "--parallelism.data_parallel_shard_degree",
            str(self.dp_shard),
            "--parallelism.tensor_parallel_degree",
            str(self.tp),
            "--parallelism.context_parallel_degree",
            str(self.cp),
            "--parallelism.pipeline_parallel_degree",
            str(self.pp),
            "--parallelism.expert_parallel_degree",
            str(self.ep),
            "--training.global_batch_size",
            str(global_batch_size),
            "--training.local_batch_size",
            str(local if local else 1),
        ]
        if self.schedule:
            out += ["--parallelism.pipeline_parallel_schedule", self.schedule]
        if self.cp > 1 and self.cp_rotate == "ulysses":
            out += ["--parallelism.context_parallel_mode", "ulysses"]
        elif self.cp > 1:
            out += ["--parallelism.context_parallel_rotate_method", self.cp_rotate]
        if self.zero_stage != 3:
            out += ["--parallelism.zero_stage", str(self.zero_stage)]
        if self.offload:
            out += ["--training.enable_cpu_offload", "true"]
        if self.tp_mode != "1d":
            out += ["--parallelism.tensor_parallel_mode", self.tp_mode]
        if self.tp_depth > 1:
            out += ["--parallelism.tensor_parallel_depth", str(self.tp_depth)]
        if self.tp_mode != "1d" and self.pp > 1:  # each microbatch splits over the grid
            out += ["--parallelism.pipeline_parallel_microbatch_size", str(self.grid_batch_split)]
        return out

    @property
    def grid_batch_split(self) -> int:
        """The ranks 2D / 2.5D / 3D tensor parallel splits each microbatch's samples over: q · d
        (grid rows × depth) for tp = q² · d, q² for a cube tp = q³; 1 for 1D."""
        from titanlab.distributed.tensor_parallel.two_d import grid_side
        from titanlab.distributed.tensor_parallel.three_d import cube_side

        if self.tp_mode == "3d":
            return (cube_side(self.tp) or 1) ** 2
        if self.tp_mode in ("2d", "2.5d"):
            return (grid_side(self.tp, self.tp_depth) or 1) * self.tp_depth
        return 1


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Ordered tuples of `parts` positive integers whose product is `n`."""
    if parts == 1:
        return [(n,)]
    return [
        (d, *rest)
        for d in range(1, n + 1)
        if n % d == 0
        for rest in _factorizations(n // d, parts - 1)
    ]


def enumerate_layouts(
    world_size: int,
    *,
    with_cp: bool = False,
    grad_accum: tuple[int, ...] = (1, 2),
    with_ep: bool = False,
    schedules: tuple[str, ...] = SCHEDULES,
    zero_stages: tuple[int, ...] = (3,),
    offload: tuple[bool, ...] = (False,),
    tp_modes: tuple[str, ...] = ("1d",),
) -> list[Layout]:
    """Every candidate layout of `world_size` ranks: each ordered factorization into
    (dp_replicate, dp_shard, cp, tp, pp) (cp only when `with_cp`), each of `schedules` when
    pp > 1, each gradient-accumulation count, each of CP's rotate methods when cp > 1, with
    `with_ep` each expert-parallel degree that divides dp_shard × cp × tp (1 included), and
    where dp_shard × cp > 1 each ZeRO stage of `zero_stages` with and without offload as
    `offload` lists (elsewhere the stage changes nothing: stage 3 only), and each tensor
    parallel mode of `tp_modes` whose grid the tp degree makes (2d: a square >= 4). Validity is
    not checked here (see `check_layout`)."""
    out = []
    for rep, shard, cp, tp, pp in _factorizations(world_size, 5):
        if cp > 1 and not with_cp:
            continue
        borrowable = shard * cp * tp
        eps = [e for e in range(1, borrowable + 1) if borrowable % e == 0] if with_ep else [1]
        rotates = CP_ROTATE_METHODS if cp > 1 else ("allgather",)
        sharded = shard * cp > 1
        zero = list(itertools.product(zero_stages, offload)) if sharded else [(3, False)]
        modes = [(m, d) for m in tp_modes for d in _grid_depths(m, tp)]
        for schedule, ga, ep, rotate, (stage, off), (mode, depth) in itertools.product(
            schedules if pp > 1 else (None,), grad_accum, eps, rotates, zero, modes
        ):
            out.append(
                Layout(rep, shard, tp, pp, schedule, ga, cp, ep, rotate, stage, off, mode, depth)
            )
    return out


def _grid_depths(mode: str, tp: int) -> list[int]:
    """The depths d of tensor parallel `mode` on tp ranks: [1] for 1d, [1] for 2d when tp = q²
    (q >= 2), every d >= 2 with tp = q² · d for 2.5d; [] when none."""
    from titanlab.distributed.tensor_parallel.two_d import grid_side

    if mode == "1d":
        return [1]
    if mode == "3d":
        from titanlab.distributed.tensor_parallel.three_d import cube_side

        return [1] if cube_side(tp) else []
    if mode == "2d":
        return [1] if grid_side(tp) else []
    return [d for d in range(2, tp + 1) if grid_side(tp, d)]


def apply_layout(config: JobConfig, layout: Layout, global_batch_size: int) -> JobConfig:
    """A copy of `config` with the layout's degrees, schedule and batch sizes."""
    local = layout.local_batch_size(global_batch_size)
    if local is None:
        raise ConfigError(
            f"training.global_batch_size={global_batch_size} does not split over "
            f"dp {layout.dp_replicate * layout.dp_shard} × grad_accum "
            f"{layout.grad_accum}"
        )
    p = dataclasses.replace(
        config.parallelism,
        data_parallel_replicate_degree=layout.dp_replicate,
        data_parallel_shard_degree=layout.dp_shard,
        tensor_parallel_degree=layout.tp,
        context_parallel_degree=layout.cp,
        pipeline_parallel_degree=layout.pp,
        expert_parallel_degree=layout.ep,
        context_parallel_rotate_method=cast(
            "CPRotateMethod", layout.cp_rotate.replace("ulysses", "allgather")
        ),
        context_parallel_mode="ulysses" if layout.cp_rotate == "ulysses" else "ring",
        # layout.schedule is one of SCHEDULES, the keys of the pipeline's schedule tables
        pipeline_parallel_schedule=cast(
            "PipelineSchedule", layout.schedule or config.parallelism.pipeline_parallel_schedule
        ),
        zero_stage=layout.zero_stage,
        tensor_parallel_mode=cast("TensorParallelMode", layout.tp_mode),
        tensor_parallel_depth=layout.tp_depth,
        pipeline_parallel_microbatch_size=layout.grid_batch_split
        if layout.tp_mode != "1d" and layout.pp > 1
        else config.parallelism.pipeline_parallel_microbatch_size,
    )
    t = dataclasses.replace(
        config.training,
        local_batch_size=local,
        global_batch_size=global_batch_size,
        enable_cpu_offload=layout.offload or config.training.enable_cpu_offload,
    )
    return dataclasses.replace(config, parallelism=p, training=t)


def check_parallel_layout(
    config: JobConfig, world_size: int, model_args, device_type: str
) -> ParallelDims:
    """The layout checks of the trainer's pre-flight: what the tensor-parallel mode, Muon and
    QK-clip do not take (`validate_tp_mode`, `check_muon`, `check_qk_clip`: no degree fixes
    them, so they come first), degrees against the world size, batch split, and
    `validate_layout`. Returns the ParallelDims; raises ConfigError (one line)."""
    from titanlab.components.builders import batch_layout  # components imports the data stack
    from titanlab.components.muon import check_muon
    from titanlab.distributed.qk_clip import check_qk_clip

    validate_tp_mode(config, model_args)
    check_muon(config)
    check_qk_clip(config, bool(getattr(model_args, "qk_norm", False)))
    dims = ParallelDims.from_config(config.parallelism, world_size)
    batch_layout(config, dims.dp_degree)
    validate_layout(config, dims, model_args, device_type)
    return dims


def check_layout(
    config: JobConfig, layout: Layout, global_batch_size: int, model_args, device_type: str
) -> str | None:
    """None when the trainer accepts `layout` on top of `config`, else its one-line refusal."""
    try:
        cfg = apply_layout(config, layout, global_batch_size)
        cfg.parallelism.validate()
        check_parallel_layout(cfg, layout.world_size, model_args, device_type)
    except ConfigError as e:
        return str(e)
    return None
