"""Qwen3-MoE under data, tensor, pipeline and expert parallelism equals one process, from one
seed checkpoint, fp32, 3 steps, within 1e-5: with the load-balance loss, and separately with the
auxiliary-loss-free expert bias (whose values after 3 steps are equal too). The debug MoE config
trains with EP 2 (on warm ranks, as run_train.sh trains it) with expert-load lines in its log,
resumes exactly, and
one checkpoint reshards EP 2 → EP 1 → EP 2 × FSDP 2 with equal losses.

The cases are generated: every layout of 2 and 4 ranks (1F1B when pipelined, with and without
gradient accumulation, every expert-parallel degree) that the trainer's validator accepts for the
MoE model. CI runs, for the aux loss, the layouts the issue names (EP 2, EP 4, EP 2 × FSDP 2,
EP 2 × TP 2, EP 2 × PP 2, EP 2 with accumulation) plus a pairwise cover of the expert-parallel
rest, and for the expert bias those of the named ones with EP 4, pipelining or accumulation; `make test-parity-full` (TITANLAB_PARITY_FULL=1) runs every accepted layout of 2
and 4 ranks, every pipeline schedule included, in both modes.

The load-balance loss is a statistic of each global microbatch (the ranks' k-th microbatches
together), so a layout that accumulates gradients or pipelines microbatches is compared with a
one-process run split into the same global microbatches. The expert bias depends on the step's
total counts only: every layout is compared with the undivided run.
"""

import json
import os
import shutil

import pytest
import torch

from conftest import RunResult, run_config
from titanlab.checkpoint.convert import DcpModelReader
from titanlab.planning.layout_cover import pairwise_subset
from titanlab.planning.layouts import SCHEDULES
from tests.coverage_spec import cover_cases
from tools import parity_matrix

BALANCING = {
    # A coefficient far above Qwen3's 0.001, so a wrongly reduced aux gradient shows in 3 steps.
    "aux_loss": ["--model.moe_load_balance_coeff", "0.1", "--model.moe_bias_update_speed", "0"],
    "expert_bias": ["--model.moe_load_balance_coeff", "0", "--model.moe_bias_update_speed", "0.01"],
}
FULL = os.environ.get("TITANLAB_PARITY_FULL") == "1"
# The layouts the issue names, as feature sets; each picks the smallest layout that has them.
NAMED = tuple(
    map(
        frozenset,
        [
            {"ep", "fsdp"},
            {"ep4"},
            {"ep", "efsdp"},
            {"ep", "tp"},
            {"ep", "pp:1F1B"},
            {"ep", "grad_accum"},
        ],
    )
)


def moe_options(mode: str) -> list[str]:
    return ["--model.name", "qwen3_moe", *BALANCING[mode]]


def _cases() -> list[tuple[str, parity_matrix.Layout]]:
    schedules = SCHEDULES if FULL else ("1F1B",)
    pool = parity_matrix.valid_layouts(
        (2, 4), moe_options("aux_loss"), with_ep=True, schedules=schedules
    )
    if FULL:
        return [(mode, lay) for mode in BALANCING for lay in pool]
    named = list(
        dict.fromkeys(
            min(
                (lay for lay in pool if need <= lay.tags),
                key=lambda lay: (lay.world_size, len(lay.features)),
            )
            for need in NAMED
        )
    )
    cover = pairwise_subset([lay for lay in pool if lay.ep > 1], must=NAMED)
    # The bias depends on the step's total counts only: CI runs it with accumulation (the
    # counts summed over microbatches, here on 2 ranks); `make test-parity-full` adds EP 4 and
    # EP × TP × PP. test_moe_debug_config_... below also checks the bias across EP 2 and a resume.
    bias = [lay for lay in named if "grad_accum" in lay.features]
    return [("aux_loss", lay) for lay in cover] + [("expert_bias", lay) for lay in bias]


CASES = _cases()


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory):
    """(mode, microbatches) -> (dataset, seed, 1-process losses, root); one seed checkpoint per
    balancing mode, one reference run per microbatch count, made on first use."""
    roots: dict[str, str] = {}

    def get(mode: str, microbatches: int):
        if mode not in roots:
            roots[mode] = str(tmp_path_factory.mktemp(f"moe_{mode}"))
        root = roots[mode]
        prepared = parity_matrix.prepare_reference(
            root, tiny_dataset, extra=moe_options(mode), microbatches=microbatches
        )
        return (*prepared, root)

    return get


def _biases(dump: str) -> dict[str, torch.Tensor]:
    reader = DcpModelReader(os.path.join(dump, "checkpoint", f"step-{parity_matrix.LAYOUT_STEPS}"))
    return {k: reader.load(k) for k in reader.tensors if k.endswith("expert_bias")}


@pytest.mark.parametrize(
    "mode, layout", cover_cases("qwen3_moe", CASES, ids=[f"{m}-{lay.name}" for m, lay in CASES])
)
def test_moe_layout_matches_single_process(mode, layout, reference):
    microbatches = parity_matrix.global_microbatches(layout) if mode == "aux_loss" else 1
    dataset, seed, losses, root = reference(mode, microbatches)
    outcome = parity_matrix.run_layout(layout, dataset, seed, losses, root, extra=moe_options(mode))
    assert outcome.error is None, outcome.report()
    print(f"qwen3_moe {mode} {layout.name}: worst |Δloss| {outcome.max_abs_diff:.3g}")
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, (layout.name, outcome.max_abs_diff)
    assert losses[parity_matrix.STEPS] < losses[1]
    if mode == "expert_bias":
        want = _biases(outcome.reference_dir)
        got = _biases(os.path.join(root, "runs", layout.name))
        assert want and want.keys() == got.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), "expert biases differ"
        assert any(v.abs().sum() > 0 for v in want.values())  # the bias did move


def _run_debug_config(
    tiny_dataset, dump, steps: int, *extra: str, nproc: int = 2, interval: int = 4
) -> RunResult:
    """train_configs/qwen3_moe_debug.toml on `nproc` warm ranks, as run_train.sh trains it."""
    return run_config(
        "train_configs/qwen3_moe_debug.toml",
        "--data.dataset_path",
        tiny_dataset,
        "--training.steps",
        str(steps),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        "--validation.enable",
        "false",
        "--debug.deterministic",
        "true",
        "--lr_scheduler.warmup_steps",
        "2",
        "--lr_scheduler.decay_ratio",
        "0",
        "--model.moe_bias_update_speed",
        "0.01",  # both balancing methods on: the bias is checkpointed state
        "--checkpoint.interval",
        str(interval),
        "--checkpoint.keep_latest_k",
        "0",
        "--checkpoint.export_at_end",
        "false",
        "--job.dump_folder",
        str(dump),
        *extra,
        nproc=nproc,
    )


def _records(dump) -> dict[int, dict]:
    with open(dump / "metrics.jsonl", encoding="utf-8") as f:
        return {r["step"]: r for r in map(json.loads, f)}


def test_moe_debug_config_trains_with_ep2_resumes_exactly_and_reshards(tiny_dataset, tmp_path):
    straight, resumed, chain = tmp_path / "straight", tmp_path / "resumed", tmp_path / "chain"
    for steps, dump in ((8, straight), (4, resumed), (8, resumed)):
        proc = _run_debug_config(tiny_dataset, dump, steps)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        if steps == 4:  # the EP 2 checkpoint the resharding chain starts from
            shutil.copytree(dump / "checkpoint" / "step-4", chain / "checkpoint" / "step-4")
    assert "ep=2" in proc.stdout and "active per token" in proc.stdout and "step-4" in proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if "expert max/mean load:" in ln]
    assert len(lines) == 4 and "moe_aux_loss:" in lines[0] and "(bias " in lines[0]  # 5..8

    want, got = _records(straight), _records(resumed)
    assert [got[s]["loss"] for s in range(1, 9)] == [want[s]["loss"] for s in range(1, 9)]
    assert got[8]["moe/0/bias_norm"] == want[8]["moe/0/bias_norm"] > 0
    assert want[8]["loss"] < want[1]["loss"]
    assert {"moe/0/max_load", "moe/0/mean_load", "moe/0/aux_loss", "moe/aux_loss"} <= set(want[1])

    # EP 2 (steps 1-4) → EP 1, FSDP 2 (5-6) → EP 2 × FSDP 2 on 4 ranks (7-8), same global batch.
    ep1 = _run_debug_config(
        tiny_dataset, chain, 6, "--parallelism.expert_parallel_degree", "1", interval=2
    )
    assert ep1.returncode == 0, ep1.stdout[-2000:] + ep1.stderr[-2000:]
    ep2_fsdp2 = _run_debug_config(
        tiny_dataset,
        chain,
        8,
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "8",
        nproc=4,
        interval=2,
    )
    assert ep2_fsdp2.returncode == 0, ep2_fsdp2.stdout[-2000:] + ep2_fsdp2.stderr[-2000:]
    assert "dp_shard=4" in ep2_fsdp2.stdout and "ep=2" in ep2_fsdp2.stdout
    resharded = _records(chain)
    diffs = [abs(resharded[s]["loss"] - want[s]["loss"]) for s in range(5, 9)]
    print(f"resharded EP 2 → EP 1 → EP 2 × FSDP 2: worst |Δloss| over steps 5-8 {max(diffs):.3g}")
    assert max(diffs) <= parity_matrix.TOLERANCE
    assert abs(resharded[8]["moe/0/bias_norm"] - want[8]["moe/0/bias_norm"]) <= 1e-6


# Fewer local experts than expert-FSDP ranks (issue 64): the stacks of `debugmodel_2_experts`
# (2 experts) on 4 FSDP ranks, in their blocks without EP (2 experts over 4 ranks) and as one
# expert per EP rank (EP 2: 1 expert over 2 efsdp ranks), with AdamW and with Muon (whose
# orthogonalization must see each expert's whole matrix, gathered from its dim-1 shards).
FEW_EXPERTS = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_2_experts"]
MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"]
FEW_EXPERT_CASES = {
    "fsdp4-adamw": (parity_matrix.Layout(1, 4, 1, 1, None, 1), []),
    "fsdp4-muon": (parity_matrix.Layout(1, 4, 1, 1, None, 1), MUON),
    "fsdp4-ep2-adamw": (parity_matrix.Layout(1, 4, 1, 1, None, 1, ep=2), []),
    "fsdp4-ep2-muon": (parity_matrix.Layout(1, 4, 1, 1, None, 1, ep=2), MUON),
}


@pytest.mark.parametrize("case", FEW_EXPERT_CASES)
def test_fewer_local_experts_than_expert_fsdp_ranks_match_one_process(
    case, tiny_dataset, tmp_path_factory
):
    from titanlab.distributed.expert_sharding import expert_shard_dim
    from titanlab.models.qwen3_moe import qwen3_moe_flavors

    layout, optimizer = FEW_EXPERT_CASES[case]
    args = qwen3_moe_flavors["debugmodel_2_experts"]
    local_experts, efsdp = args.moe.num_experts // layout.ep, layout.dp_shard // layout.ep
    assert local_experts < efsdp  # the case this test exists for: the stacks shard on dim 1
    assert expert_shard_dim((local_experts, args.moe.hidden_dim, args.dim), efsdp) == 1

    extra = [*FEW_EXPERTS, *BALANCING["aux_loss"], *optimizer]
    root = str(tmp_path_factory.getbasetemp() / f"few_experts_{'muon' if optimizer else 'adamw'}")
    dataset, seed, losses = parity_matrix.prepare_reference(
        root, tiny_dataset, extra=extra, microbatches=parity_matrix.global_microbatches(layout)
    )
    outcome = parity_matrix.run_layout(layout, dataset, seed, losses, root, extra=extra)
    assert outcome.error is None, outcome.report()
    print(f"qwen3_moe 2 experts {case}: worst |Δloss| {outcome.max_abs_diff:.3g}")
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, (case, outcome.max_abs_diff)
    assert losses[parity_matrix.STEPS] < losses[1]
