"""Activation memory under pipeline parallel: what each schedule keeps in flight.

A pipeline rank keeps a microbatch's activations from its forward on a stage until that
stage's backward of it: the whole backward ("B"), or for zero-bubble schedules, which split
backward into the input gradient ("I") and the weight gradient ("W"), until "W" (torch's
`stage_backward_input` keeps the autograd graph for the weight gradient). How many are alive
at once is the schedule's: all microbatches under GPipe and LoopedBFS (every forward before the
first backward), pp − rank under 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", §2.2), and in between for the interleaved
and zero-bubble schedules. The order of each rank's forwards and backwards is taken from
torch.distributed.pipelining's own schedule classes, the ones the trainer runs
(`titanlab.distributed.pipeline.build_schedule`), built on stand-in stages (the order depends
only on the stage indices, the pp size and the microbatch count).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from torch import nn

from titanlab.distributed.pipeline import LOOPED, SINGLE, V_SHAPE, stage_ids, stages_per_rank

# (kind, stage index) of one rank's compute actions, in order: kind F, B, I or W.
Actions = list[tuple[str, int]]


@functools.lru_cache(maxsize=512)  # the planner asks for each (schedule, pp, m) many times
def rank_actions(schedule: str, pp: int, microbatches: int, per_rank: int) -> dict[int, Actions]:
    """Each pp rank's forwards and backwards, in the order torch's `schedule` runs them.

    Args:
        schedule: a `parallelism.pipeline_parallel_schedule` name; pp: ranks (≥ 2);
        microbatches: per step; per_rank: `pipeline_parallel_stages_per_rank` (looped ones).
    Returns:
        {pp rank: [(kind, stage index), ...]} (shared: do not modify); kind "F" forward, "B" full backward, "I"/"W" the
        input and weight halves of a split backward (an overlapped F+B is listed as F then B).
    Raises:
        ValueError: an unknown schedule, or a microbatch count the schedule refuses.
    """
    if schedule not in {**SINGLE, **LOOPED, **V_SHAPE}:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of "
                         f"{sorted({**SINGLE, **LOOPED, **V_SHAPE})}")  # fmt: skip
    spr = stages_per_rank(schedule, per_rank)
    n_stages = pp * spr
    stand_in = nn.Module()  # the zero-bubble schedules look for FSDP on a stage's module
    stages: list[Any] = [  # stand-ins: the schedules read only these attributes
        SimpleNamespace(
            group_size=pp,
            group_rank=0,
            num_stages=n_stages,
            stage_index=s,
            is_first=s == 0,
            is_last=s == n_stages - 1,
            submod=stand_in,
        )
        for s in stage_ids(schedule, 0, pp, spr)
    ]
    if schedule in SINGLE:
        single: Any = SINGLE[schedule]
        order = single(stages[0], n_microbatches=microbatches)._get_pipeline_order()
    else:
        cls = LOOPED.get(schedule) or V_SHAPE[schedule]
        order = cls(stages, n_microbatches=microbatches).pipeline_order
    return {rank: _flatten(acts) for rank, acts in (order or {}).items()}


def _flatten(actions) -> Actions:
    out: Actions = []
    for a in actions:
        if a is None:
            continue
        for sub in a.sub_actions or (a,):
            kind = sub.computation_type.value
            if kind in ("F", "B", "I", "W"):
                out.append((kind, sub.stage_index))
    return out


def peak_in_flight(
    actions: Actions,
    bytes_of: Callable[[int], int],
    after_backward: int = 0,
    pending_of: Callable[[int], int] = lambda stage: 0,
) -> tuple[int, bool]:
    """The peak, over one rank's action list, of the bytes of microbatches whose forward on a
    stage ran and whose backward did not finish (`bytes_of(stage)` each; freed at "B", or at
    "W" after a split backward), plus `pending_of(stage)` from a split backward's "I" to its
    "W" (the weight ops' output gradients; `titanlab.planning.split_backward`; none on stage 0,
    whose I does nothing), plus `after_backward` (the stage's gradients) once a backward has
    run: (those in-flight bytes, whether a backward had run)."""
    live = best = 0
    backward_ran = False
    at_peak = (0, False)
    for kind, stage in actions:
        if kind in ("F", "I"):
            live += bytes_of(stage) if kind == "F" else (pending_of(stage) if stage else 0)
            total = live + (after_backward if backward_ran or kind == "I" else 0)
            if total > best:
                best, at_peak = total, (live, backward_ran or kind == "I")
        elif kind in ("B", "W"):
            live -= bytes_of(stage) + (pending_of(stage) if kind == "W" and stage else 0)
        backward_ran = backward_ran or kind in ("B", "I")
    return at_peak


def stage_layer_counts(model, config, n_stages: int) -> list[int]:
    """Transformer blocks on each stage, split as the trainer splits them
    (`titanlab.distributed.pipeline.pipeline_model`): the configured module names, a
    cost-balanced split, or `layers_per_stage`."""
    from titanlab.distributed.pipeline import layers_per_stage, split_counts

    p = config.parallelism
    if p.pipeline_parallel_module_fqns_per_stage:
        return [sum(name.startswith("layers.") for name in entry.split())
                for entry in p.pipeline_parallel_module_fqns_per_stage]  # fmt: skip
    counts = split_counts(model, config, n_stages)
    return counts or layers_per_stage(
        len(model.layers), n_stages, p.pipeline_parallel_layers_per_stage
    )


@dataclass(frozen=True)
class RankLoad:
    """What one pipeline rank holds (its stages differ: the first has the embedding, the last
    the final norm, the output and the loss; V schedules put both on rank 0)."""

    in_flight: int  # activation bytes of its microbatches in flight, at its peak
    transient: int  # the last stage's backward working bytes (0 without the last stage)
    grads_alive: bool  # whether a backward had run at that peak (gradients exist)
    params: int  # elements of its stages' parameters, unsharded
    gathered: int  # elements of its stages' parameters as gathered (tp- and ep-local)
    largest_unit: int  # gathered elements of its largest FSDP unit outside the blocks
    buffers: int  # bytes of the receive buffers its stages allocate for every microbatch


def rank_loads(
    model, config, blocks_bytes: Callable[[int], int], head: int, boundary: int, transient: int,
    grads_of: Callable[[int, int], int], gathered_of: Callable[[nn.Module], int],
    pending: tuple[int, int] = (0, 0),
) -> list[RankLoad]:  # fmt: skip
    """Each pipeline rank's load for `config`'s schedule, pp degree and microbatches.

    Args:
        blocks_bytes(n): what n blocks of one stage keep for one microbatch (the AC mode's).
        head: what the last stage's head keeps per microbatch (final norm, output, loss).
        boundary: bytes of a stage's output for one microbatch: kept for its backward (but
            the last stage's), and the size of each receive buffer (`PipelineStage` allocates
            one per microbatch for its input and, but on the last stage, its output gradient).
        transient: the last stage's working memory in a microbatch's backward (the logits'
            gradients), alive while that microbatch's activations are.
        grads_of(params, gathered): gradient bytes of a rank with that many parameter elements
            (unsharded, and as gathered), alive once a backward has run.
        gathered_of(module): a module's parameter elements as its rank gathers them.
        pending: (per block, for the head) bytes a split backward keeps from its input half to
            its weight half, per microbatch (`titanlab.planning.split_backward`).
    """
    from titanlab.planning.meta_counts import params as count_params

    p = config.parallelism
    pp, per = p.pipeline_parallel_degree, p.pipeline_parallel_stages_per_rank
    schedule = p.pipeline_parallel_schedule
    spr = stages_per_rank(schedule, per)
    n_stages = pp * spr
    counts = stage_layer_counts(model, config, n_stages)
    microbatches = config.training.local_batch_size // p.pipeline_parallel_microbatch_size
    blocks = list(model.layers.values())
    first = [sum(counts[:i]) for i in range(n_stages)]
    embed = model.tok_embeddings
    tail = [m for m in (model.norm, model.output) if m is not None]

    def modules(stage: int) -> list[nn.Module]:
        own = blocks[first[stage] : first[stage] + counts[stage]]
        return own + ([embed] if stage == 0 else []) + (tail if stage == n_stages - 1 else [])

    def bytes_of(stage: int) -> int:
        return blocks_bytes(counts[stage]) + (head if stage == n_stages - 1 else boundary)

    def pending_of(stage: int) -> int:
        return pending[0] * counts[stage] + (pending[1] if stage == n_stages - 1 else 0)

    stage_params = [sum(count_params(m) for m in modules(s)) for s in range(n_stages)]
    stage_gathered = [sum(gathered_of(m) for m in modules(s)) for s in range(n_stages)]
    out = []
    for rank, actions in rank_actions(schedule, pp, microbatches, per).items():
        ids = stage_ids(schedule, rank, pp, spr)
        params = sum(stage_params[s] for s in ids)
        gathered = sum(stage_gathered[s] for s in ids)
        peak, alive = peak_in_flight(actions, bytes_of, grads_of(params, gathered), pending_of)
        units = ([gathered_of(embed)] if 0 in ids else []) + (
            [sum(gathered_of(m) for m in tail)] if n_stages - 1 in ids else []
        )
        receives = sum((s > 0) + (s < n_stages - 1) for s in ids)
        out.append(RankLoad(
            in_flight=peak, transient=transient if n_stages - 1 in ids else 0,
            grads_alive=alive, params=params,
            gathered=gathered,
            largest_unit=max(units, default=0), buffers=receives * microbatches * boundary,
        ))  # fmt: skip
    return out
