"""tools/lib/muon_bench.py: repeats pooled, the ranks' Newton–Schulz balance, the table."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
from tools.lib import muon_bench as mb  # noqa: E402


def _measured(step, opt, ns):
    return mb.Measured(step_s=list(step), optimizer_s={r: list(x) for r, x in enumerate(opt)},
                       ns_s={r: list(x) for r, x in enumerate(ns)})  # fmt: skip


def test_merge_pools_the_repeats_per_rank():
    a = _measured([1.0, 1.2], [[0.1], [0.2]], [[0.05], [0.06]])
    b = _measured([1.4], [[0.3], [0.4]], [[0.07], [0.08]])
    m = mb.merge([a, b])
    assert m.step_s == [1.0, 1.2, 1.4]
    assert m.ns_s == {0: [0.05, 0.07], 1: [0.06, 0.08]}
    assert mb.merge([a, mb.Measured(error="exit 1: boom")]).error == "exit 1: boom"


def test_balance_is_the_slowest_ranks_median_over_the_mean():
    m = _measured([1.0], [[0.1], [0.1]], [[0.02, 0.04, 0.03], [0.01, 0.01, 0.01]])
    mean, slowest = mb.balance(m)
    assert mean == (0.03 + 0.01) / 2
    assert slowest == 0.03 / mean  # 1.5


def test_table_has_a_row_per_layout_with_the_step_ratio():
    results = {}
    for layout in mb.LAYOUTS:
        results[(layout, "AdamW")] = _measured([1.0, 1.0], [[0.01], [0.01]], [[0.0], [0.0]])
        results[(layout, "Muon")] = _measured([1.1, 1.1], [[0.05], [0.06]], [[0.03], [0.03]])
    results[("TP 2", "Muon")] = mb.Measured(error="exit 1: boom")
    rows = mb.render(results).splitlines()[2:]
    assert len(rows) == len(mb.LAYOUTS)
    assert rows[1].startswith("| FSDP 2 | 1.000 | 1.100 | 1.10× | 0.010 | 0.060 | 0.030 | 1.00 |")
    assert "exit 1: boom" in rows[-1]
