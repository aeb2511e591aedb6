"""Document masking (data.document_mask, data.reset_positions) in the trainer: under TP 2 and
PP 2 the losses equal 1 process (1e-5, 3 steps, one seed checkpoint) and the masking changes the
losses (it is on). (Data without EOS: tests/integration/test_error_lines.py.)

The data are short documents (the functions of stdlib modules, ~20-200 tokens), so every
64-token window holds several document boundaries.
"""

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from tests.coverage_spec import cover_layout  # noqa: E402
from titanlab.data.default_corpus import default_corpus_files  # noqa: E402
from titanlab.data.prepare import prepare_data  # noqa: E402
from titanlab.data.tokenizer import default_tokenizer_path  # noqa: E402
from titanlab.planning.layouts import Layout  # noqa: E402
from tools import parity_matrix  # noqa: E402

MASK = ["--data.document_mask", "true", "--data.reset_positions", "true"]
FULL_ONLY = pytest.mark.skipif(
    os.environ.get("TITANLAB_PARITY_FULL") != "1", reason="make test-parity-full runs it"
)
LAYOUTS = {
    "tp2": Layout(1, 1, 2, 1, None, 1),
    "pp2-1F1B": Layout(1, 1, 1, 2, "1F1B", 1),
    "fsdp2-tp2": Layout(1, 2, 2, 1, None, 1),
    "fsdp2-ga2": Layout(1, 2, 1, 1, None, 2),
}
# CI meets document masking × TP 2 and × PP 2 in the feature-pair matrix's covering rows.
PARAMS = [
    pytest.param(n, marks=(FULL_ONLY, cover_layout("llama3", lay, "document-mask")))
    for n, lay in LAYOUTS.items()
]


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("docs")
    with open(root / "docs.jsonl", "w", encoding="utf-8") as out:
        for path in default_corpus_files()[:40]:
            with open(path, encoding="utf-8") as f:
                for part in f.read().split("\ndef ")[1:]:
                    out.write(json.dumps({"text": "def " + part[:600]}) + "\n")
    prepared = str(root / "prepared")
    prepare_data([str(root / "docs.jsonl")], prepared, default_tokenizer_path(), progress=False)
    return prepared


@pytest.fixture(scope="module")
def reference(short_docs, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("docmask"))
    return (*parity_matrix.prepare_reference(root, short_docs, extra=MASK), root)


@pytest.mark.parametrize("name", PARAMS)
def test_document_masked_layout_matches_single_process(name, reference):
    dataset, seed, losses, root = reference
    outcome = parity_matrix.run_layout(LAYOUTS[name], dataset, seed, losses, root, extra=MASK)
    assert outcome.error is None, outcome.report()
    assert outcome.max_abs_diff <= parity_matrix.TOLERANCE, outcome.max_abs_diff


def test_masking_changes_the_losses(reference):
    """The reference above really masks: the same run without it trains to other losses."""
    dataset, seed, losses, root = reference
    plain = parity_matrix.run_layout(Layout(1, 1, 1, 1, None, 1), dataset, seed, losses, root)
    assert plain.error is None
    assert plain.max_abs_diff > 1e-3
