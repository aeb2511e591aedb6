"""Every pair of features either trains like one process (and exports whole) or is refused before
launch with one line naming both options: the generated feature-pair matrix of
`tools/feature_pairs.py`.

CI runs the covering rows (every supported pair in at least one row, compiled with aot_eager);
with TITANLAB_PARITY_FULL=1 (`make test-parity-full`) the rows also cover every supported triple
of EP 2 or PP 2 × a PEFT level × a third factor's level, compiled with Inductor. The counts of
supported / refused / failed pairs (and triples) are printed; failed must be 0.
"""

import os
import sys
from itertools import combinations

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from tools.lib import feature_runs as runs  # noqa: E402
from tools.lib import feature_matrix as fp  # noqa: E402
from tools.lib import feature_verdicts as fv  # noqa: E402
from tools.lib.feature_covering import covering_rows  # noqa: E402
from tools.lib.runs import read_losses  # noqa: E402
from tests.coverage_spec import accepts, layout_cells, layout_dims  # noqa: E402

FULL = os.environ.get("TITANLAB_PARITY_FULL") == "1"

LEVEL_CELLS = {
    ("ac", "none"): "ac:none",
    ("ac", "full"): "ac:full",
    ("ac", "selective_op"): "ac:selective-op",
    ("ac", "selective_2"): "ac:selective-layer",
    ("precision", "fp32"): "precision:float32",
    ("precision", "bf16"): "precision:bfloat16",
    ("precision", "fp16"): "precision:float16",
    ("float8", "on"): "precision:float8",
}
"""The cover cells (tests/coverage_spec.py) of levels the rows train: every level of a
supported pair is in a row, and the test below checks that these are."""


def _family(model: fp.Level) -> str:
    return model.args[model.args.index("--model.name") + 1]


MODEL_LAYOUTS = [
    (model, layout)
    for model in fp.FACTORS["model"]
    for layout in fp.FACTORS["layout"]
    if accepts(_family(model), layout.layout)
]
"""The model × layout pairs the validator accepts: the rows train each (checked below), so
each meets its family under the layout's dimensions."""
FEATURE_LEVELS = {
    ("optimizer", "muon"): "muon",
    ("peft", "lora_attention"): "lora",
    ("peft", "qlora"): "qlora",
    ("distill", "on"): "distill",
    ("data", "chat"): "chat-sft",
    ("data", "document_mask"): "document-mask",
    ("compile", "on"): "compile",
    ("loss", "fused"): "fused-loss",
}
"""The levels that train a feature of the cover (`coverage_spec.FEATURES`)."""
REFUSED_LAYOUTS = {("peft", "qlora", "ddp2"), ("peft", "qlora", "ep2"), ("distill", "on", "cp2")}
"""The feature × layout pairs the pre-flight refuses (docs/feature_pairs.md), checked below."""
FEATURE_LAYOUTS = [
    (lv, lay)
    for lv in (lv for levels in fp.FACTORS.values() for lv in levels)
    if (lv.factor, lv.name) in FEATURE_LEVELS
    for lay in fp.FACTORS["layout"]
    if (lv.factor, lv.name, lay.name) not in REFUSED_LAYOUTS
]
"""The feature × layout pairs the rows train (checked below): each meets the feature under the
layout's dimensions."""
COVER = [
    "pairs:feature-matrix",
    *LEVEL_CELLS.values(),
    *sorted({c for m, lay in MODEL_LAYOUTS for c in layout_cells(_family(m), lay.layout)}),
    *sorted(
        {
            f"{FEATURE_LEVELS[lv.factor, lv.name]}×{dim}"
            for lv, lay in FEATURE_LAYOUTS
            for dim in layout_dims(lay.layout)
        }
    ),
]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """(fixtures, companions, verdicts, work dir): the seed checkpoints and data, and the
    pre-flight's verdict on every pair."""
    root = str(tmp_path_factory.mktemp("feature_pairs"))
    fixtures = runs.make_fixtures(root)
    helpers = fv.companions(fixtures)
    return fixtures, helpers, fv.pair_verdicts(fixtures, helpers), root


def level(factor: str, name: str) -> fp.Level:
    return next(lv for lv in fp.FACTORS[factor] if lv.name == name)


def test_every_refusal_is_one_line_naming_both_options(matrix):
    _, helpers, verdicts, _ = matrix
    refused = {pair: why for pair, why in verdicts.items() if why is not None}
    assert all("\n" not in why for why in refused.values())
    unnamed = [f"{a.label} × {b.label}: {why}" for (a, b), why in refused.items()
               if not fv.names_both((a, b), why, helpers)]  # fmt: skip
    assert not unnamed, "\n".join(unnamed)
    # The pairs of issue 29 that must be refused, not crash after launch (packed chat data
    # under CP, refused then, trains since issue 55: tests/integration/test_cp_documents.py).
    for pair, words in [
        (("model", "moe", "peft", "lora_router"), "router of an MoE model is not a LoRA target"),
    ]:
        a, b = level(*pair[:2]), level(*pair[2:])
        why = verdicts.get((a, b)) or verdicts.get((b, a))
        assert why is not None and words in why, (pair, why)


@pytest.mark.cover(*COVER)
def test_supported_pairs_train_like_one_process_and_export_whole(matrix):
    fixtures, helpers, verdicts, root = matrix
    triples = fv.triple_verdicts(fixtures, helpers, verdicts) if FULL else {}
    rows = covering_rows(verdicts, fixtures, helpers, triples=triples)
    in_rows = {frozenset(c) for row in rows for n in (2, 3) for c in combinations(row.values(), n)}
    supported = [pair for pair, why in verdicts.items() if why is None]
    assert all(frozenset(pair) in in_rows for pair in supported)
    # what the cover credits this test with (COVER) is in the rows
    levels = {(lv.factor, lv.name) for row in rows for lv in row.values()}
    assert set(LEVEL_CELLS) <= levels, set(LEVEL_CELLS) - levels
    assert all(frozenset(pair) in in_rows for pair in MODEL_LAYOUTS), [
        f"{m.label} × {lay.label}" for m, lay in MODEL_LAYOUTS if frozenset((m, lay)) not in in_rows
    ]
    assert all(frozenset(t) in in_rows for t, why in triples.items() if why is None)
    verdict = {frozenset(pair): why for pair, why in verdicts.items()}
    assert [f"{lv.label} × {lay.label}" for lv, lay in FEATURE_LAYOUTS
            if verdict[frozenset((lv, lay))] is not None] == []  # fmt: skip
    assert all(frozenset(pair) in in_rows for pair in FEATURE_LAYOUTS)
    assert all(verdict[frozenset((level(f, n), level("layout", lay)))] is not None
               for f, n, lay in REFUSED_LAYOUTS)  # fmt: skip
    # CI compiles with aot_eager (the capture, where features meet compile); the full run with
    # Inductor.
    backend = "inductor" if FULL else "aot_eager"
    outcomes = runs.run_rows(rows, fixtures, root, backend)
    failed = [o for o in outcomes if not o.passed]
    refused = len(verdicts) - len(supported)
    print(f"\nfeature pairs: supported {len(supported)} / refused {refused} / failed "
          f"{len(failed)} ({len(rows)} rows)")  # fmt: skip
    if triples:
        print(f"EP/PP × PEFT triples: supported {sum(w is None for w in triples.values())} / "
              f"refused {sum(w is not None for w in triples.values())}")  # fmt: skip
    for o in outcomes:
        print(f"  {'pass' if o.passed else 'FAIL'} {o.row}: |Δloss| {o.max_abs_diff} "
              f"(≤ {o.tolerance:g}) export [{o.export}] {o.seconds:.0f}s")  # fmt: skip
    assert not failed, "\n".join(f"{o.row}: {o.error or o.max_abs_diff}" for o in failed)


def test_selective_op_ac_with_expert_parallel_under_fsdp_equals_full_ac(matrix):
    """Issue 29's repro: op-level SAC × EP 2 × FSDP 2 crashed in the first backward; it trains
    and its losses equal full AC's within 1e-5."""
    fixtures, _, _, root = matrix
    losses = {}
    for ac in ("full", "selective_op"):
        row = fp.row_with(level("model", "moe"), level("layout", "ep2"), level("ac", ac))
        dump = os.path.join(root, "sac_ep", ac)
        error = runs._run(fp.WORLD_SIZE, fp.row_args(row, fixtures), dump)
        assert error is None, error
        losses[ac] = read_losses(dump)
    assert sorted(losses["full"]) == list(range(1, fp.STEPS + 1))
    worst = max(abs(losses["full"][s] - losses["selective_op"][s]) for s in losses["full"])
    assert worst <= fp.FP32_TOLERANCE, losses
