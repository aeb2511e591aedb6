"""Context parallel with document masks (data.document_mask + reset_positions) and Ulysses CP:
the losses of 4 steps equal 1 process within 1e-5 (one seed checkpoint), over short documents
of mixed lengths (~20-200 tokens: every 64-token window holds several boundaries, some
crossing the cp shard boundaries).

CI: ring CP 2 (allgather, alltoall), CP 4, Ulysses 2, Ulysses without documents, and one
composition (CP 2 × FSDP 2); `make test-parity-full` adds CP 2 × TP 2, × PP 2 and the rest.
"""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from titanlab.planning.layouts import Layout  # noqa: E402
from tools import parity_matrix  # noqa: E402

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
PARAMS = [pytest.param(n, marks=() if n in CI else FULL_ONLY) for n in CASES]


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


def test_ulysses_without_documents_matches_single_process(tmp_path):
    dataset, seed, losses = parity_matrix.prepare_reference(str(tmp_path))
    layout = Layout(1, 1, 1, 1, None, 1, cp=2)
    outcome = parity_matrix.run_layout(layout, dataset, seed, losses, str(tmp_path), extra=ULYSSES)
    assert outcome.error is None, outcome.report()
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, outcome.max_abs_diff
