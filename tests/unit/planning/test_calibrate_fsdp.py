"""FSDP2's calibrated overheads: the arithmetic that separates them from the α–β time, and the
units the timed model has."""

import dataclasses

import pytest

from titanlab.config.manager import build_config
from titanlab.models.common.counting import count_params
from titanlab.planning import planner
from titanlab.planning.calibrate_fsdp import BLOCKS, fsdp_overheads, unit_params
from titanlab.planning.memory import _meta_model

JOB = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "128"]


def test_the_units_are_the_blocks_the_embedding_and_the_head():
    args = planner.model_args_of(build_config(JOB))
    units = unit_params(args)
    assert len(units) == BLOCKS + 2 < args.n_layers + 2 and units[0] == units[1]
    assert units[-2] == args.vocab_size * args.dim  # the embedding
    assert units[-1] == args.vocab_size * args.dim + args.dim  # the norm's weight + the output
    assert sum(units) == count_params(_meta_model(dataclasses.replace(args, n_layers=BLOCKS)))
    assert (
        len(unit_params(dataclasses.replace(args, n_layers=1))) == 3
    )  # no more blocks than it has


def test_the_overheads_are_what_the_times_hold_beyond_the_ring_model():
    """Times built from the α–β model plus known overheads give those overheads back: 4 ranks,
    units of 1000, 1000, 3000 and 4000 fp32 parameters, α 2 ms, β 1 GB/s."""
    n, alpha, beta, units = 4, 2e-3, 1e9, [1000, 1000, 3000, 4000]
    gather_s, reduce_s, compute = 5e-3, 3e-3, 0.25

    def ring(params: int) -> float:  # one all-gather or reduce-scatter of fp32 parameters
        return 3 * alpha + 3 / 4 * params * 4 / beta

    ddp = compute + 2 * (ring(1000) + ring(1000) + ring(7000))  # two blocks, then the root
    zero2 = compute + sum(2 * ring(u) + gather_s + reduce_s for u in units)
    zero3 = zero2 + sum(ring(u) + gather_s for u in units[:-1])  # the head stays gathered
    got = fsdp_overheads((zero2 - ddp, zero3 - zero2), n, units, 4, 4, alpha, beta)
    assert got == pytest.approx((gather_s, reduce_s))
    # times that hold less than the model's own collectives give 0, not a negative cost
    assert fsdp_overheads((0.0, 0.0), n, units, 4, 4, alpha, beta) == (0.0, 0.0)
