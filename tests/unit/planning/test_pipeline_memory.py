"""What each pipeline schedule keeps in flight: the order of forwards and backwards from torch's
own schedule classes, the peak of the microbatches alive on each rank, and the memory estimate
that follows the schedule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanlab.config.job_config import JobConfig
from titanlab.models.llama3 import llama3_flavors
from titanlab.planning.memory import estimate_memory
from titanlab.distributed.pipeline import LOOPED, SINGLE, V_SHAPE, stage_ids, stages_per_rank
from titanlab.planning.activation_memory import trace_activation_bytes
from titanlab.planning.pipeline_memory import peak_in_flight, rank_actions, rank_loads


def in_flight(schedule: str, pp: int, microbatches: int, per_rank: int = 2) -> dict[int, int]:
    """Peak count of (stage, microbatch) activations alive per rank."""
    acts = rank_actions(schedule, pp, microbatches, per_rank)
    return {rank: peak_in_flight(a, lambda stage: 1)[0] for rank, a in acts.items()}


@pytest.mark.parametrize("pp,microbatches", [(2, 8), (4, 8), (4, 4)])
def test_gpipe_keeps_every_microbatch_and_1f1b_pp_minus_rank(pp, microbatches):
    assert in_flight("GPipe", pp, microbatches) == {r: microbatches for r in range(pp)}
    assert in_flight("1F1B", pp, microbatches) == {
        r: min(pp - r, microbatches) for r in range(pp)
    }  # Narayanan et al. 2021 §2.2


def test_the_looped_and_zero_bubble_schedules_sit_between():
    """pp 2, 8 microbatches, 2 stages per rank: LoopedBFS runs all 16 stage-forwards before a
    backward; the others keep far fewer."""
    assert in_flight("LoopedBFS", 2, 8) == {0: 16, 1: 16}
    assert in_flight("Interleaved1F1B", 2, 8) == {0: 5, 1: 3}
    assert in_flight("InterleavedZeroBubble", 2, 8) == {0: 4, 1: 4}
    assert in_flight("ZBVZeroBubble", 2, 8) == {0: 4, 1: 4}
    assert in_flight("DualPipeV", 2, 8) == {0: 5, 1: 5}


def test_a_split_backward_frees_at_the_weight_gradient():
    actions = [("F", 0), ("F", 0), ("I", 0), ("F", 0), ("W", 0), ("B", 0), ("F", 0)]
    assert peak_in_flight(actions, lambda s: 10) == (30, True)  # "I" freed nothing
    # Gradients (5) alive once a backward ran: the peak is the later one, with them.
    assert peak_in_flight([("F", 0), ("F", 0), ("B", 0), ("F", 0)], lambda s: 10, 5) == (
        20,
        True,
    )
    assert peak_in_flight([("F", 0), ("F", 0), ("B", 0), ("F", 0)], lambda s: 10) == (20, False)


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="'Zigzag' is not one of"):
        rank_actions("Zigzag", 2, 4, 1)


def debug_pp(schedule: str, local_batch: int = 8) -> JobConfig:
    c = JobConfig()
    c.model.flavor = "debugmodel"
    c.training.seq_len, c.training.local_batch_size = 128, local_batch
    c.parallelism.data_parallel_shard_degree = 2
    c.parallelism.pipeline_parallel_degree = 2
    c.parallelism.pipeline_parallel_schedule = schedule
    c.loss.chunk_size = 64  # a microbatch of 128 tokens: the fused loss (auto) in 2 chunks
    return c


def test_the_estimate_follows_the_schedule():
    """Debug model (6 blocks, split 3 + 3), FSDP 2 × PP 2, 8 microbatches of 1 sample: under
    1F1B rank 0 keeps 2 microbatches, the last rank 1 with the head's saved tensors (the fused
    loss's weight gradient, 4352 × 256 fp32, among them); under GPipe the last rank keeps all 8.
    The estimate is the rank whose peak is largest."""
    args = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=4352, max_seq_len=128)
    block = trace_activation_bytes(args, 1, 128, torch.float32).per_block["none"]
    head = trace_activation_bytes(args, 1, 128, torch.float32, fused_chunk=128).head
    boundary = 128 * 256 * 4  # a stage's output (and receive buffer) per microbatch
    model = _meta(args)

    def loads(schedule):
        return rank_loads(model, debug_pp(schedule), lambda n: n * block, head, boundary, 7,
                          lambda n, local: 0, lambda m: sum(p.numel() for p in m.parameters()))  # fmt: skip

    first, last = loads("1F1B")
    assert (first.in_flight, last.in_flight) == (2 * (3 * block + boundary), 3 * block + head)
    assert (first.transient, last.transient) == (0, 7)
    # rank 0 receives output gradients, rank 1 inputs: one buffer per microbatch
    assert first.buffers == last.buffers == 8 * boundary
    embed = 4352 * 256
    assert first.params - embed == last.params - embed - 256  # the final norm's weight
    assert loads("GPipe")[1].in_flight == 8 * (3 * block + head)
    estimates = {s: estimate_memory(args, debug_pp(s), 4, torch.float32) for s in ("1F1B", "GPipe")}
    assert estimates["1F1B"].activations == first.in_flight  # 2 microbatches outweigh the head
    assert estimates["GPipe"].activations == 8 * (3 * block + head)
    # Each stage's whole gradients (fp32) until its last microbatch's backward, then one
    # reduce-scatter: alive through 1F1B's later forwards, not through GPipe's.
    assert estimates["1F1B"].grads == 4 * first.params
    assert estimates["1F1B"].grads_during_forward and not estimates["GPipe"].grads_during_forward


def _meta(args):
    from titanlab.models.registry import build_model

    with torch.device("meta"):
        return build_model(args)


@pytest.mark.parametrize("schedule", sorted({**SINGLE, **LOOPED, **V_SHAPE}))
@pytest.mark.parametrize("pp,factor", [(2, 1), (2, 4), (4, 2)])
def test_every_schedule_runs_each_forward_once_and_frees_it(schedule, pp, factor):
    """Every schedule the trainer offers, generated: each rank runs each of its stages' forwards
    once per microbatch and frees each (B, or W after a split backward), so nothing is in
    flight at the end and the peak lies between 1 and all of them."""
    spr = stages_per_rank(schedule, 2)
    microbatches = pp * spr * factor  # as many as stages at least (DualPipeV asks it)
    for rank, actions in rank_actions(schedule, pp, microbatches, 2).items():
        ids = stage_ids(schedule, rank, pp, spr)
        forwards = [s for kind, s in actions if kind == "F"]
        assert sorted(forwards) == sorted(ids * microbatches)
        frees = [s for kind, s in actions if kind == "B" or kind == "W"]
        assert sorted(frees) == sorted(forwards)
        peak, _ = peak_in_flight(actions, lambda s: 1)
        assert 1 <= peak <= microbatches * spr
