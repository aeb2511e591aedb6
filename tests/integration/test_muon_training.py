"""Muon on every layout trains as one process does; a resumed Muon run is bitwise the straight
one (its momentum buffers are DTensors in the checkpoint), and one saved on FSDP 2 resumes on
TP 2.

The layouts are generated as the parity matrix generates them (`tools/parity_matrix.py`: every
layout of 2 and 4 ranks, ZeRO 1-3, the trainer's validator keeping the valid ones with Muon
on), for the dense model and for the MoE model with expert parallel; the full run adds 2D TP
on 4 ranks and 2.5D / 3D TP on 8 (each grid weight's pieces assembled on its owner: the
placements are checked in CI by tests/unit/components/test_muon_sharded.py).
CI runs the MoE model's pairwise subset (EP with FSDP, HSDP, DDP, TP and PP, FSDP × TP's
strided shards among them) and the dense model's ZeRO 1 and 2 on 2 ranks; `make
test-parity-full` runs every valid layout of both, with every pipeline schedule and gradient
accumulation. Each starts from one seed checkpoint; losses of 3 steps within 1e-5 of 1 process.
"""

import os

import pytest

from conftest import CONSTANT_LR, SHALLOW, checkpoint_every, read_metrics
from titanlab.planning.layout_cover import pairwise_subset
from titanlab.planning.layouts import SCHEDULES
from tests.coverage_spec import cover_cases
from tools import parity_matrix

FULL = os.environ.get("TITANLAB_PARITY_FULL") == "1"
TOLERANCE = parity_matrix.TOLERANCE
# float32 Newton-Schulz: bfloat16's (torch's default) turns the last-bit differences of another
# reduction order into 1e-5 loss differences within 4 steps (TP 2: 1.7e-5 at step 4)
MUON_OPTIONS = ["--optimizer.name", "Muon", "--optimizer.lr", "0.01",
                "--optimizer.muon_ns_dtype", "float32"]  # fmt: skip
# No load-balance statistic (taken per global microbatch): one reference serves every layout.
MOE_OPTIONS = [*MUON_OPTIONS, "--model.name", "qwen3_moe", "--model.moe_load_balance_coeff",
               "0", "--model.moe_bias_update_speed", "0"]  # fmt: skip


def _cases() -> list[tuple[str, parity_matrix.Layout]]:
    schedules = SCHEDULES if FULL else ("1F1B",)
    grad_accum = (1, 2) if FULL else (1,)
    dense = parity_matrix.valid_layouts((2, 4), MUON_OPTIONS, zero_stages=(1, 2, 3),
                                        schedules=schedules, grad_accum=grad_accum)  # fmt: skip
    moe = [lay for lay in parity_matrix.valid_layouts(
        (2, 4), MOE_OPTIONS, with_ep=True, schedules=schedules, grad_accum=grad_accum
    ) if lay.ep > 1]  # fmt: skip
    if FULL:  # and 2D / 2.5D / 3D tensor parallel: their weights are DTensors on the grid
        grids = parity_matrix.valid_layouts((4, 8), MUON_OPTIONS, tp_modes=("2d", "2.5d", "3d"))
        dense += [lay for lay in grids if lay.tp_mode != "1d"]
        return [("dense", lay) for lay in dense] + [("moe", lay) for lay in moe]
    zero = [lay for lay in dense if lay.world_size == 2 and lay.dp_kind == "fsdp"
            and not lay.grad_accum > 1]  # fmt: skip
    return [("dense", lay) for lay in zero] + [("moe", lay) for lay in pairwise_subset(moe)]


CASES = _cases()


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory):
    """model -> (dataset, seed, 1-process losses, root), made on first use."""
    made: dict[str, tuple] = {}

    def get(model: str):
        if model not in made:
            root = str(tmp_path_factory.mktemp(f"muon_{model}"))
            extra = MUON_OPTIONS if model == "dense" else MOE_OPTIONS
            made[model] = (*parity_matrix.prepare_reference(root, tiny_dataset, extra), root)
        return made[model]

    return get


@pytest.mark.parametrize(
    "model, layout",
    cover_cases(
        lambda c: "llama3" if c[0] == "dense" else "qwen3_moe",
        CASES,
        ids=[f"{m}-{lay.name}" for m, lay in CASES],
        feature="muon",
    ),
)
def test_muon_layout_matches_one_process(model, layout, reference):
    dataset, seed, losses, root = reference(model)
    extra = MUON_OPTIONS if model == "dense" else MOE_OPTIONS
    outcome = parity_matrix.run_layout(layout, dataset, seed, losses, root, extra=extra)
    assert outcome.error is None, outcome.report()
    print(f"muon {model} {layout.name}: worst |Δloss| {outcome.max_abs_diff:.3g}")
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, (layout.name, outcome.max_abs_diff)
    assert losses[parity_matrix.STEPS] < losses[1]  # Muon trains


MUON = [*MUON_OPTIONS, "--training.steps", "4", "--training.global_batch_size", "4",
        "--checkpoint.enable", "false"]  # fmt: skip


@pytest.mark.cover("resume-kill9:disabled")
def test_muon_killed_rank_resumes_bit_for_bit(tiny_dataset, tmp_path):
    """kill -9 of a rank after the step-4 checkpoint: torchrun restarts the group, which loads
    the momentum buffers (DTensors in the checkpoint) and trains steps 5-8 bit for bit as the
    straight run (bfloat16 Newton-Schulz, the default: the same reduction order), on the thin
    flavor (`conftest.THIN`: the dim-256 model's made this test 147 s on an AVX2 CPU, 41 s)."""
    from conftest import THIN, assert_killed_rank_resumes_bit_for_bit

    options = [*MUON_OPTIONS[:4], *THIN]
    assert_killed_rank_resumes_bit_for_bit(tiny_dataset, str(tmp_path), options)


def test_muon_saved_on_fsdp2_resumes_on_tp2(train, tmp_path):
    """The momentum buffers reshard like the weights: FSDP 2's Shard(0) buffers saved at step 3
    load into TP 2's Shard(0)/Shard(1) ones, and steps 4-6 equal the straight FSDP 2 run's."""
    args = [*MUON_OPTIONS, *CONSTANT_LR, *checkpoint_every(3, "--checkpoint.keep_latest_k", "0"),
            "--training.global_batch_size", "8", "--training.local_batch_size", "4"]  # fmt: skip
    straight = str(tmp_path / "straight")
    train(2, *args, "--training.steps", "6", dump=straight).check()
    resumed = str(tmp_path / "resumed")
    train(2, *args, "--training.steps", "3", dump=resumed).check()
    # 1 data-parallel rank instead of 2: its local batch is the global one (the sampler converts
    # the data position)
    tp2 = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8"]
    second = train(2, *args, *tp2, "--training.steps", "6", dump=resumed).check()
    assert "step-3" in second.stdout and sorted(second.losses) == [4, 5, 6]
    want, got = read_metrics(straight), read_metrics(resumed)
    worst = max(abs(got[s] - want[s]) for s in (4, 5, 6))
    print(f"muon FSDP 2 -> TP 2 resume: worst |Δloss| {worst:.3g}")
    assert worst <= parity_matrix.TOLERANCE, (got, want)


QK_CLIP = [*MUON, "--optimizer.qk_clip_threshold", "0.45"]  # the debug model's logits: ~0.4-0.55
QK_LAYOUTS = {
    "fsdp2": [],
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def qk_clip_one_process(tiny_dataset, tmp_path_factory):
    from conftest import TINY, launch

    dump = str(tmp_path_factory.mktemp("qk_clip_1"))
    launch(1, [*TINY, "--data.dataset_path", tiny_dataset, "--job.dump_folder", dump,
               *QK_CLIP, "--training.local_batch_size", "4"]).check()  # fmt: skip
    return _qk_records(dump)


def _qk_records(dump: str) -> dict[int, dict]:
    import json

    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


QK_DIMS = {"fsdp2": "dp_shard", "tp2": "tp", "pp2": "pp"}
QK_PARAMS = [pytest.param(n, marks=pytest.mark.cover(f"qk-clip×{QK_DIMS[n]}")) for n in QK_LAYOUTS]


@pytest.mark.parametrize("name", QK_PARAMS)
def test_qk_clip_layout_matches_one_process(name, qk_clip_one_process, train, tmp_path):
    """MuonClip's maxima are reduced over the data-parallel ranks, the TP ranks' heads and the
    pipeline stages' layers: every layout clips the same heads and trains like 1 process."""
    dump = str(tmp_path / name)
    train(2, *QK_CLIP, *QK_LAYOUTS[name], dump=dump).check()
    want, got = qk_clip_one_process, _qk_records(dump)
    assert sorted(got) == [1, 2, 3, 4]
    assert sum(r["qk_clip/clipped_heads"] for r in want.values()) > 0  # the clip acted
    for step in got:
        assert abs(got[step]["loss"] - want[step]["loss"]) <= TOLERANCE, (name, step)
        assert got[step]["qk_clip/clipped_heads"] == want[step]["qk_clip/clipped_heads"]
        for layer in range(int(SHALLOW[1])):  # each layer's largest logit, logged
            key = f"qk_clip/layer.{layer}/max_logit"
            assert abs(got[step][key] - want[step][key]) <= 1e-5, (name, step, key)
