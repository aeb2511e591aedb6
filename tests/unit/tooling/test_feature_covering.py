"""tools/lib/feature_covering.py's `prune`: rows whose pairs other rows cover run eagerly or go,
and every wanted pair stays covered."""

import itertools

from tools.lib.feature_covering import prune
from tools.lib.feature_matrix import FACTORS, FIRST


def pairs(row) -> set:
    return {frozenset(c) for c in itertools.combinations(row.values(), 2)}


def test_a_compiled_row_covered_elsewhere_runs_eagerly_and_a_duplicate_goes():
    compiled = {**FIRST, "compile": FACTORS["compile"][1]}
    eager = dict(FIRST)
    rows = [dict(compiled), eager, dict(compiled)]  # the second compiled row covers the first
    wanted = set().union(*(pairs(r) for r in rows))
    kept = prune(rows, wanted)
    assert set().union(*(pairs(r) for r in kept)) >= wanted  # nothing lost
    assert sum(r["compile"].name == "on" for r in kept) == 1
    assert len(kept) == 2


def test_rows_each_covering_a_pair_of_their_own_all_stay():
    rows = [{**FIRST, "layout": lv} for lv in FACTORS["layout"]]
    wanted = set().union(*(pairs(r) for r in rows))
    assert prune(rows, wanted) == rows
