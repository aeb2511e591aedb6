"""The generated layout matrix: enumeration, the validator's verdicts, and the pairwise subset."""

import itertools
import os
import sys

import pytest

from titanlab.config.job_config import ConfigError

from titanlab.planning.layout_cover import pairwise_subset
from titanlab.planning.layouts import SCHEDULES, Layout, enumerate_layouts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
from tools import parity_matrix  # noqa: E402


@pytest.fixture(scope="module")
def verdicts():
    return parity_matrix.matrix()


def test_enumeration_is_every_factorization_schedule_and_accumulation():
    layouts = enumerate_layouts(4)
    degrees = {(l.dp_replicate, l.dp_shard, l.tp, l.pp) for l in layouts}
    expected = {d for d in itertools.product((1, 2, 4), repeat=4) if d[0] * d[1] * d[2] * d[3] == 4}
    assert degrees == expected
    assert all(l.world_size == 4 and l.cp == 1 for l in layouts)
    pp_layouts = [l for l in layouts if l.pp > 1]
    assert {l.schedule for l in pp_layouts} == set(SCHEDULES) and len(SCHEDULES) == 7
    assert len(layouts) == len(set(layouts))
    # 10 degree tuples; the 4 with pp > 1 take each of 7 schedules; × 2 accumulation counts
    assert len(layouts) == 2 * (6 + 4 * 7)
    assert any(l.cp == 2 for l in enumerate_layouts(4, with_cp=True))


def test_layout_names_are_unique_and_readable():
    zero = {"zero_stages": (0, 1, 2, 3), "offload": (False, True), "with_cp": True,
            "tp_modes": ("1d", "2d", "2.5d", "3d")}  # fmt: skip
    layouts = [l for ws in (1, 2, 4, 8) for l in enumerate_layouts(ws, **zero)]
    assert len({l.name for l in layouts}) == len(layouts)
    assert Layout(2, 1, 1, 2, "1F1B", 2).name == "ws4-ddp2-pp2-1F1B-ga2"
    assert Layout(2, 2, 2, 1, None, 1).name == "ws8-hsdp2x2-tp2"
    assert Layout(1, 2, 1, 1, None, 1, zero_stage=1).name == "ws2-fsdp2-zero1"
    assert Layout(1, 2, 1, 1, None, 1, offload=True).name == "ws2-fsdp2-zero3-offload"
    assert Layout(1, 1, 4, 1, None, 2, tp_mode="2d").name == "ws4-tp4-2d-ga2"


def test_zero_stages_are_enumerated_only_where_ranks_shard():
    zero = {"zero_stages": (0, 1, 2, 3), "offload": (False, True)}
    layouts = enumerate_layouts(2, with_cp=True, grad_accum=(1,), **zero)
    by_degrees: dict[tuple, set] = {}
    for lay in layouts:
        key = (lay.dp_replicate, lay.dp_shard, lay.cp, lay.tp, lay.pp)
        by_degrees.setdefault(key, set()).add((lay.zero_stage, lay.offload))
    every = set(itertools.product((0, 1, 2, 3), (False, True)))
    assert by_degrees[(1, 2, 1, 1, 1)] == every and by_degrees[(1, 1, 2, 1, 1)] == every
    assert by_degrees[(2, 1, 1, 1, 1)] == {(3, False)} == by_degrees[(1, 1, 1, 2, 1)]
    args = Layout(1, 2, 1, 1, None, 1, zero_stage=2, offload=True).overrides(8)
    assert args[args.index("--parallelism.zero_stage") + 1] == "2"
    assert args[args.index("--training.enable_cpu_offload") + 1] == "true"
    assert "--parallelism.zero_stage" not in Layout(1, 2, 1, 1, None, 1).overrides(8)


def test_the_validator_refuses_the_zero_stages_a_layout_cannot_mean(verdicts):
    refused = {lay.name: why for lay, why in verdicts if why}
    valid = {lay.name for lay, why in verdicts if why is None}
    assert "zero_stage=0" in refused["ws2-cp2-zero0"]  # DDP cannot shard the sequence's ranks
    assert "enable_cpu_offload" in refused["ws2-fsdp2-zero1-offload"]
    assert {"ws2-fsdp2-zero0", "ws2-fsdp2-zero1", "ws2-fsdp2-zero2-offload"} <= valid
    assert "ws8-hsdp2x2-tp2-zero0" in valid


def test_overrides_keep_the_global_batch():
    lay = Layout(2, 2, 1, 2, "GPipe", 2)
    args = lay.overrides(8)
    assert args[args.index("--training.local_batch_size") + 1] == "1"  # 8 / (2·2·2)
    assert args[args.index("--training.global_batch_size") + 1] == "8"
    assert Layout(1, 8, 1, 1, None, 2).local_batch_size(8) is None


def test_every_candidate_is_accepted_or_refused_with_one_line(verdicts):
    zero = {
        "zero_stages": (0, 1, 2, 3),
        "offload": (False, True),
        "tp_modes": ("1d", "2d", "2.5d", "3d"),
    }
    candidates = [enumerate_layouts(ws, with_cp=True, **zero) for ws in (1, 2, 4, 8)]
    assert len(verdicts) == sum(map(len, candidates))
    refusals = [why for _, why in verdicts if why is not None]
    assert refusals and all("\n" not in why and why for why in refusals)
    valid = {lay.name for lay, why in verdicts if why is None}
    # The layouts that trained wrong or were refused before issue 16 are valid now.
    for name in (
        "ws4-ddp2-pp2-1F1B",
        "ws4-ddp2-pp2-GPipe",
        "ws4-ddp2-pp2-Interleaved1F1B",
        "ws4-ddp2-tp2",
        "ws8-hsdp2x2-pp2-1F1B",
        "ws8-fsdp2-tp2-pp2-1F1B",
    ):
        assert name in valid
    refused = dict((lay.name, why) for lay, why in verdicts if why)
    assert "must divide the number of heads" in refused["ws4-tp4"]
    assert "DualPipeV" in refused["ws4-ddp2-pp2-DualPipeV"]


def test_ci_subset_covers_every_pair_that_can_meet(verdicts):
    valid = [lay for lay, why in verdicts if why is None]
    subset = parity_matrix.ci_layouts()
    assert set(subset) <= set(valid)

    def pairs(lays):
        """Pairs of features met at FSDP2's default (stage 3, no offload)."""
        return {
            frozenset(p)
            for lay in lays
            if lay.zero_stage == 3 and not lay.offload
            for p in itertools.combinations(sorted(lay.features), 2)
        }

    def zero_pairs(lays):
        """(ZeRO stage or offload, parallelism) pairs, the schedules and degrees as one, and
        offload with each stage it can have."""
        out = set()
        for lay in lays:
            parallelisms = {
                "pp" if lay.pp > 1 else None,
                "tp" if lay.tp > 1 else None,
                "cp" if lay.cp > 1 else None,
                "grad_accum" if lay.grad_accum > 1 else None,
                lay.dp_kind,
            } - {None}
            variant = {f"stage{lay.zero_stage}"} if lay.zero_stage != 3 else set()
            variant |= {"offload"} if lay.offload else set()
            out |= {(v, p) for v in variant for p in parallelisms | {""}}
            out |= {("offload", f"stage{lay.zero_stage}")} if lay.offload else set()
        return out

    in_ci = [lay for lay in valid if parity_matrix.in_ci(lay)]
    assert pairs(in_ci) == pairs(subset)
    assert not any(lay.variants or lay.tp_mode != "1d" for lay in subset)
    # The full matrix's pairwise cover meets each ZeRO variant with every parallelism.
    full = pairwise_subset(valid, must=parity_matrix.MUST)
    assert zero_pairs(valid) == zero_pairs(full)
    have = {v for v, _ in zero_pairs(full)} | {p for v, p in zero_pairs(full) if v == "offload"}
    assert {"stage0", "stage1", "stage2", "offload", "stage3"} <= have, have
    names = {lay.name for lay in subset}
    kinds = {(lay.dp_kind, lay.schedule) for lay in subset}
    for schedule in (
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
    ):  # DualPipeV is refused on a sub-mesh
        assert ("ddp", schedule) in kinds and ("hsdp", schedule) in kinds
    assert any(lay.dp_kind == "hsdp" and lay.tp > 1 for lay in subset)
    assert any(
        lay.world_size == 8 and lay.pp > 1 and lay.tp > 1 and lay.dp_kind == "fsdp"
        for lay in subset
    ), names
    assert len(subset) < len(valid) / 3  # a subset, not the matrix


def test_2d_tensor_parallel_is_enumerated_on_square_degrees_and_meets_dp_and_pp(verdicts):
    modes = {(l.tp, l.tp_mode) for l in enumerate_layouts(8, tp_modes=("1d", "2d"))}
    assert (4, "2d") in modes and (2, "2d") not in modes and (8, "2d") not in modes
    refused = {lay.name: why for lay, why in verdicts if why}
    valid = {lay.name for lay, why in verdicts if why is None}
    # 4 heads and 2 KV heads: 1D cannot split them 4 ways, the 2 × 2 grid splits them 2 ways.
    assert "must divide the number of heads" in refused["ws4-tp4"]
    assert {"ws4-tp4-2d", "ws4-tp4-2d-ga2"} <= valid
    assert "ws8-tp8-3d" in valid  # a 2 × 2 × 2 cube
    assert {"ws8-tp8-2.5dx2", "ws8-tp8-2.5dx2-ga2"} <= valid  # 2 grids of 2 × 2
    # data parallel outside the grid (FSDP2 over its SPMD mesh), pipeline stages of grids
    assert {"ws8-fsdp2-tp4-2d", "ws8-ddp2-tp4-2d", "ws8-fsdp2-tp4-2d-zero1"} <= valid
    assert {"ws8-tp4-2d-pp2-1F1B", "ws8-tp4-2d-pp2-Interleaved1F1B-ga2"} <= valid
    assert "context_parallel_degree=2 is not supported yet" in refused["ws8-cp2-tp4-2d"]
    args = Layout(1, 1, 4, 2, "1F1B", 1, tp_mode="2d").overrides(8)
    assert args[args.index("--parallelism.tensor_parallel_mode") + 1] == "2d"
    # each pipeline microbatch splits over the grid rows: 2 samples on a 2 × 2 grid
    assert args[args.index("--parallelism.pipeline_parallel_microbatch_size") + 1] == "2"


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--compile.enable", "true"], "tensor_parallel_mode=2d with compile.enable=true"),
        (["--model.name", "qwen3"], "(per-head q/k norms) is not supported yet"),
        (["--parallelism.tensor_parallel_degree", "8"], "q² × tensor_parallel_depth (1)"),
    ],
)
def test_2d_tensor_parallel_refusals_are_one_line(extra, says):
    from titanlab.planning.layouts import check_layout

    config, args = parity_matrix._base_config(extra)
    tp = 8 if "8" in extra else 4
    why = check_layout(config, Layout(1, 1, tp, 1, None, 1, tp_mode="2d"), 8, args, "cpu")
    assert why is not None and says in why and "\n" not in why, why
    from titanlab.distributed.parallel_dims import ParallelDims

    config.parallelism.tensor_parallel_mode = "2d"
    config.parallelism.tensor_parallel_degree = 6
    with pytest.raises(Exception, match="not 6"):
        ParallelDims.from_config(config.parallelism, 6)


def test_2d_pipeline_microbatches_must_split_over_the_grid_rows():
    from titanlab.planning.layouts import apply_layout, check_parallel_layout

    config, args = parity_matrix._base_config([])
    cfg = apply_layout(config, Layout(1, 1, 4, 2, "1F1B", 1, tp_mode="2d"), 8)
    assert cfg.parallelism.pipeline_parallel_microbatch_size == 2
    check_parallel_layout(cfg, 8, args, "cpu")  # accepted
    cfg.parallelism.pipeline_parallel_microbatch_size = 1
    with pytest.raises(ConfigError) as e:
        check_parallel_layout(cfg, 8, args, "cpu")
    assert "pipeline_parallel_microbatch_size=1; use a multiple of 2" in str(e.value)
