"""Every parallel layout trains the same model to the same losses as one process.

The layouts are generated, not listed: `tools/parity_matrix.py` enumerates every layout of 1, 2,
4 and 8 ranks, the trainer's validator keeps the valid ones, and CI runs the pairwise subset
(every pair of features that can meet, meets once: PP × DDP, PP × HSDP, HSDP × TP, each schedule
× each data-parallel kind, PP × TP × FSDP on 8 ranks, ...; the ZeRO stage / offload
variants and 2D / 2.5D / 3D TP are in the full matrix only, `tools/parity_matrix.in_ci`).
`make test-parity-full` runs them all.
Every run starts from one seed checkpoint, uses the same global batch of 8 samples × 64 tokens,
fp32 and deterministic mode; the losses of steps 1-3 must equal the 1-process run's within 1e-5 (which trains 5 steps
and must lower its loss: `parity_matrix.LAYOUT_STEPS`).
"""

import os
import sys

import pytest

from conftest import CI_COMPILE_BACKEND

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from titanlab.planning.layouts import Layout  # noqa: E402
from tests.coverage_spec import cover_cases, cover_layout  # noqa: E402
from tools import parity_matrix  # noqa: E402

# PP × DDP trained wrong before FSDP2's replicate replaced the reducer-based DDP (issue 16):
# the three schedules measured then, on 4 ranks, are always run.
REGRESSIONS = [Layout(2, 1, 1, 2, s, 1) for s in ("GPipe", "1F1B", "Interleaved1F1B")]
LAYOUTS = {lay.name: lay for lay in parity_matrix.ci_layouts() + REGRESSIONS}

# Options that are not layouts, each on the layout it changes. Context parallel's ring runs
# inside each activation-checkpointing mode's recomputation and under torch.compile; the
# compiled runs are left to `make test-parity-full` (CI meets CP × compile × AC in the
# feature-pair matrix's covering rows).
CP2 = Layout(1, 1, 1, 1, None, 1, cp=2)
FULL_ONLY = pytest.mark.skipif(
    os.environ.get("TITANLAB_PARITY_FULL") != "1", reason="make test-parity-full runs it"
)
OPTIONS = {
    "tp2_no_loss_parallel": Layout(1, 1, 2, 1, None, 1),
    "pp2_split_flops": Layout(1, 1, 1, 2, "1F1B", 1),  # blocks 6 + 2 instead of 4 + 4
    # ZeRO-1 toggles FSDP2's gradient sync and resharding per microbatch around compiled blocks
    "fsdp2_zero1_ga2_compile": Layout(1, 2, 1, 1, None, 2, zero_stage=1),
    "cp2_ac_full": CP2,
    "cp2_ac_selective_op": CP2,
    "cp2_ac_selective_2": CP2,
    "cp2_compile_ac_selective_op": CP2,
    "cp2_alltoall_compile": Layout(1, 1, 1, 1, None, 1, cp=2, cp_rotate="alltoall"),
}
OPTION_ARGS = {
    "tp2_no_loss_parallel": ["--parallelism.disable_loss_parallel", "true"],
    "pp2_split_flops": ["--parallelism.pipeline_parallel_split", "flops"],
    # aot_eager in CI: FSDP2's hooks and ZeRO-1's per-microbatch toggles meet the captured blocks
    "fsdp2_zero1_ga2_compile": ["--compile.enable", "true", *CI_COMPILE_BACKEND],
    "cp2_ac_full": ["--activation_checkpoint.mode", "full"],
    "cp2_ac_selective_op": ["--activation_checkpoint.mode", "selective"],
    "cp2_ac_selective_2": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
    ],
    "cp2_compile_ac_selective_op": [
        "--compile.enable",
        "true",
        "--activation_checkpoint.mode",
        "selective",
    ],
    "cp2_alltoall_compile": ["--compile.enable", "true"],
}
# CI runs CP with full and selective-op AC; every-2nd-block AC recomputes the same ring as
# full AC does, so `make test-parity-full` runs that one, and the compiled CP runs (CI meets
# CP × compile × AC in the feature-pair matrix's covering rows).
FULL_ONLY_OPTIONS = ("cp2_alltoall_compile", "cp2_ac_selective_2", "cp2_compile_ac_selective_op")
OPTION_CELLS = {
    "cp2_ac_full": ["ac:full"],
    "cp2_ac_selective_op": ["ac:selective-op"],
    "cp2_ac_selective_2": ["ac:selective-layer"],
    "cp2_compile_ac_selective_op": ["ac:selective-op"],
}
"""The cover cells each option meets beyond its layout's (tests/coverage_spec.py)."""
OPTION_PARAMS = [
    pytest.param(
        name,
        marks=[
            cover_layout("llama3", OPTIONS[name]),
            pytest.mark.cover(*OPTION_CELLS.get(name, [])),
            *([FULL_ONLY] if name in FULL_ONLY_OPTIONS else []),
        ],
    )
    for name in OPTIONS
]


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory):
    """(dataset, seed checkpoint, 1-process losses, work folder)."""
    root = str(tmp_path_factory.mktemp("parity"))
    return (*parity_matrix.prepare_reference(root, tiny_dataset), root)


def _assert_matches(outcome, reference_losses):
    assert outcome.error is None, outcome.report()
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, (outcome.layout, outcome.max_abs_diff)
    assert reference_losses[parity_matrix.STEPS] < reference_losses[1]  # the reference trains


@pytest.mark.cover("pairs:layout-matrix", "precision:float32", "ac:none")
@pytest.mark.parametrize("name", cover_cases("llama3", list(LAYOUTS), layout=LAYOUTS.get))
def test_layout_matches_single_process(name, reference):
    dataset, seed, losses, root = reference
    _assert_matches(parity_matrix.run_layout(LAYOUTS[name], dataset, seed, losses, root), losses)


@pytest.mark.parametrize("name", OPTION_PARAMS)
def test_option_matches_single_process(name, reference):
    dataset, seed, losses, root = reference
    outcome = parity_matrix.run_layout(
        OPTIONS[name],
        dataset,
        seed,
        losses,
        os.path.join(root, name),
        extra=OPTION_ARGS[name],
        shallow=name != "pp2_split_flops",  # its split of the flavor's 8 blocks is what it tests
    )
    _assert_matches(outcome, losses)
