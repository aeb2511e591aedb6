import pytest

from tools.plan_check import spearman


def test_spearman_of_hand_worked_rankings():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # ranks 0..3 against 0, 2, 1, 3: d² = 0 + 1 + 1 + 0 → 1 − 6·2 / (4 · 15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # ties share the mean rank: x ranks (0, 1.5, 1.5, 3)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)


def test_passes_combine_to_the_mean_step_and_the_largest_peak():
    from tools.plan_check import combined

    assert combined([(1.0, 10), (3.0, 30)]) == (2.0, 30)
    assert combined([(1.0, 10), "exit 1"]) == "exit 1"  # a failed pass fails the layout
