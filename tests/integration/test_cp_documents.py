"""Context parallel with document masks (data.document_mask + reset_positions) and Ulysses CP:
the losses of 4 steps equal 1 process within 1e-5 (one seed checkpoint), over short documents
of mixed lengths (~20-200 tokens: every 64-token window holds several boundaries, some
crossing the cp shard boundaries).

Packed chat SFT (prompt tokens masked, samples packed with restarted positions) runs the
same way. MoE: Qwen3-MoE under CP 2 × EP 2 and DeepSeek-V3 (multi-head latent attention)
under CP 2 and Ulysses 2.

CI: ring CP 2 (allgather, alltoall), CP 4, Ulysses 2, Ulysses without documents, chat SFT under
CP 2, CP 2 × FSDP 2 and CP 2 × EP 2; `make test-parity-full` adds CP 2 × TP 2, × PP 2 and the
rest.
"""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from tests.coverage_spec import layout_cells  # noqa: E402
from titanlab.planning.layouts import Layout  # noqa: E402
from tools import parity_matrix  # noqa: E402
from tools.lib.feature_runs import write_chat_data  # noqa: E402

from tests.integration.test_document_mask_parity import MASK, short_docs  # noqa: E402,F401

FULL_ONLY = pytest.mark.skipif(
    os.environ.get("TITANLAB_PARITY_FULL") != "1", reason="make test-parity-full runs it"
)
ULYSSES = ["--parallelism.context_parallel_mode", "ulysses"]
CASES = {
    # name: (layout, extra options)
    "cp2-allgather": (Layout(1, 1, 1, 1, None, 1, cp=2), []),
    "cp2-alltoall": (Layout(1, 1, 1, 1, None, 1, cp=2, cp_rotate="alltoall"), []),
    "cp4-allgather": (Layout(1, 1, 1, 1, None, 1, cp=4), []),
    "cp4-alltoall": (Layout(1, 1, 1, 1, None, 1, cp=4, cp_rotate="alltoall"), []),
    "ulysses2": (Layout(1, 1, 1, 1, None, 1, cp=2), ULYSSES),
    "cp2-fsdp2": (Layout(1, 2, 1, 1, None, 1, cp=2), []),
    "cp2-tp2": (Layout(1, 1, 2, 1, None, 1, cp=2), []),
    "cp2-pp2": (Layout(1, 1, 1, 2, "1F1B", 1, cp=2), []),
    "cp2-head-tail": (
        Layout(1, 1, 1, 1, None, 1, cp=2),
        ["--parallelism.context_parallel_load_balancer", "head_tail"],
    ),
}
CI = ("cp2-allgather", "cp2-alltoall", "cp4-alltoall", "ulysses2", "cp2-fsdp2")


def _cells(family: str, layout: Layout, extra: list[str], *features: str) -> list[str]:
    """The cover cells (tests/coverage_spec.py) of a case: `family` and each of `features` under
    the layout's dimensions (Ulysses when `extra` asks for it)."""
    cells = {c for f in features for c in layout_cells(family, layout, feature=f)}
    return sorted(cells | ({"ulysses×cp"} if "ulysses" in extra else set()))


def _params(cases: dict, in_ci, *features: str, family=lambda name: "llama3") -> list:
    """`cases` (name: (layout, extra options)) as parameters, marked with their cells; those
    `in_ci(name)` refuses run in make test-full only."""
    return [
        pytest.param(
            name,
            marks=(
                pytest.mark.cover(*_cells(family(name), lay, extra, *features)),
                *(() if in_ci(name) else (FULL_ONLY,)),
            ),
        )
        for name, (lay, extra) in cases.items()
    ]


PARAMS = _params(CASES, lambda name: name in CI, "document-mask")


@pytest.fixture(scope="module")
def reference(short_docs, tmp_path_factory):  # noqa: F811
    root = str(tmp_path_factory.mktemp("cpdocs"))
    return (*parity_matrix.prepare_reference(root, short_docs, extra=MASK), root)


@pytest.mark.parametrize("name", PARAMS)
def test_document_masked_cp_matches_single_process(name, reference):
    dataset, seed, losses, root = reference
    layout, extra = CASES[name]
    outcome = parity_matrix.run_layout(layout, dataset, seed, losses, root, extra=MASK + extra)
    assert outcome.error is None, outcome.report()
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, outcome.max_abs_diff


@pytest.mark.cover("ulysses×cp", "llama3×cp")
def test_ulysses_without_documents_matches_single_process(tmp_path):
    dataset, seed, losses = parity_matrix.prepare_reference(str(tmp_path))
    layout = Layout(1, 1, 1, 1, None, 1, cp=2)
    outcome = parity_matrix.run_layout(layout, dataset, seed, losses, str(tmp_path), extra=ULYSSES)
    assert outcome.error is None, outcome.report()
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, outcome.max_abs_diff


CHAT = {
    "cp2-allgather": (Layout(1, 1, 1, 1, None, 1, cp=2), []),
    "cp2-alltoall": (Layout(1, 1, 1, 1, None, 1, cp=2, cp_rotate="alltoall"), []),
    "cp4-allgather": (Layout(1, 1, 1, 1, None, 1, cp=4), []),
    "cp4-alltoall": (Layout(1, 1, 1, 1, None, 1, cp=4, cp_rotate="alltoall"), []),
    "ulysses2": (Layout(1, 1, 1, 1, None, 1, cp=2), ULYSSES),
}


@pytest.fixture(scope="module")
def chat_reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cpchat"))
    data = os.path.join(root, "sft")
    write_chat_data(data)
    return (*parity_matrix.prepare_reference(root, data), root)


@pytest.mark.parametrize(
    "name", _params(CHAT, lambda name: name == "cp2-allgather", "chat-sft", "document-mask")
)
def test_packed_chat_sft_under_cp_matches_single_process(name, chat_reference):
    dataset, seed, losses, root = chat_reference
    layout, extra = CHAT[name]
    outcome = parity_matrix.run_layout(layout, dataset, seed, losses, root, extra=extra)
    assert outcome.error is None, outcome.report()
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, outcome.max_abs_diff


MOE = {
    "qwen3_moe-cp2-ep2": (
        Layout(1, 1, 1, 1, None, 1, cp=2, ep=2),
        ["--model.name", "qwen3_moe", "--model.moe_load_balance_coeff", "0.1"],
    ),
    "deepseek_v3-cp2": (Layout(1, 1, 1, 1, None, 1, cp=2), ["--model.name", "deepseek_v3"]),
    "deepseek_v3-ulysses2": (
        Layout(1, 1, 1, 1, None, 1, cp=2),
        ["--model.name", "deepseek_v3", *ULYSSES],
    ),
}


MOE_CI = ("qwen3_moe-cp2-ep2", "deepseek_v3-ulysses2")  # MLA's only CP without documents


@pytest.mark.parametrize(
    "name",
    _params(MOE, lambda n: n in MOE_CI, "document-mask", family=lambda n: n.split("-")[0]),
)
def test_moe_families_under_document_masked_cp_match_single_process(
    name,
    short_docs,  # noqa: F811
    tmp_path,
):
    layout, extra = MOE[name]
    model = [a for a in extra if a not in ULYSSES]
    root = str(tmp_path)
    dataset, seed, losses = parity_matrix.prepare_reference(root, short_docs, extra=MASK + model)
    outcome = parity_matrix.run_layout(layout, dataset, seed, losses, root, extra=MASK + extra)
    assert outcome.error is None, outcome.report()
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, outcome.max_abs_diff


@pytest.mark.cover("resume-kill9:disabled", "llama3×cp")
@FULL_ONLY  # CI: the kill -9 resumes of test_faults.py and the CP layouts of this module
def test_killed_cp2_document_masked_run_resumes_bit_for_bit(short_docs, tmp_path):  # noqa: F811
    """kill -9 of a rank after the step-4 checkpoint of a CP 2 document-masked run: torchrun
    restarts the group, which loads the checkpoint and trains steps 5-8 bit for bit as the
    straight run (the batches, their shards and the data position come back alike)."""
    from conftest import assert_killed_rank_resumes_bit_for_bit

    cp = ["--parallelism.context_parallel_degree", "2",
          "--parallelism.context_parallel_rotate_method", "alltoall"]  # fmt: skip
    assert_killed_rank_resumes_bit_for_bit(short_docs, str(tmp_path), [*cp, *MASK])


OPTIONS = {
    "compile": ["--compile.enable", "true"],
    "compile-ac-selective-op": [
        "--compile.enable",
        "true",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ],
    "compile-ac-full": ["--compile.enable", "true", "--activation_checkpoint.mode", "full"],
    "ac-full": ["--activation_checkpoint.mode", "full"],
    "ac-selective-op": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ],
    "ac-selective-2": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
    ],
    "lora": ["--peft.method", "lora", "--peft.rank", "4", "--peft.target_modules", "wq,wv"],
    "fused-loss": ["--loss.fused_linear_cross_entropy", "true", "--loss.chunk_size", "32"],
}


OPTION_CELLS = {
    "compile": ["compile×cp"],
    "compile-ac-selective-op": ["compile×cp", "ac:selective-op"],
    "compile-ac-full": ["compile×cp", "ac:full"],
    "ac-full": ["ac:full"],
    "ac-selective-op": ["ac:selective-op"],
    "ac-selective-2": ["ac:selective-layer"],
    "lora": ["lora×cp"],
    "fused-loss": ["fused-loss×cp"],
}
"""The cover cells (tests/coverage_spec.py) of each option, besides document masking under CP."""
assert OPTION_CELLS.keys() == OPTIONS.keys()


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            n,
            marks=(
                pytest.mark.cover("document-mask×cp", "llama3×cp", *cells),
                *(() if n == "ac-full" else (FULL_ONLY,)),
            ),
        )
        for n, cells in OPTION_CELLS.items()
    ],
)
def test_document_masked_cp2_with_an_option_matches_single_process(
    name,
    short_docs,  # noqa: F811
    tmp_path,
):
    """CP 2 (alltoall) with compile, an AC mode, LoRA or the fused loss equals 1 process with
    the same option."""
    root, extra = str(tmp_path), MASK + OPTIONS[name]
    dataset, seed, losses = parity_matrix.prepare_reference(root, short_docs, extra=extra)
    layout = Layout(1, 1, 1, 1, None, 1, cp=2, cp_rotate="alltoall")
    outcome = parity_matrix.run_layout(layout, dataset, seed, losses, root, extra=extra)
    assert outcome.error is None, outcome.report()
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, outcome.max_abs_diff
