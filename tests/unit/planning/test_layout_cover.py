"""`pairwise_subset`: the greedy pairwise covering of layouts, on a toy set (the parity matrix's
cover is checked in tests/unit/planning/test_layouts.py)."""

from titanlab.planning.layout_cover import pairwise_subset
from titanlab.planning.layouts import Layout


def test_pairwise_subset_on_a_toy():
    a = Layout(2, 1, 1, 1, None, 2)  # ddp + grad_accum, 2 ranks
    b = Layout(1, 1, 2, 1, None, 2)  # tp + grad_accum, 2 ranks
    c = Layout(2, 1, 2, 1, None, 1)  # ddp + tp, 4 ranks
    d = Layout(2, 1, 2, 1, None, 2)  # all three on 4 ranks: covers every pair alone
    e = Layout(1, 1, 1, 1, None, 1)  # no feature at all: never needed
    assert pairwise_subset([a, b, c, d, e]) == pairwise_subset([a, b, c, d, e])  # deterministic
    assert pairwise_subset([d, e]) == [d]
    assert set(pairwise_subset([a, b, c, e])) == {a, b, c}
    assert pairwise_subset([a, b, c, d], must=(frozenset({"ddp", "tp"}),))[0] == c  # cheapest
