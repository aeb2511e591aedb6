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


def test_saved_measurements_map_back_onto_the_candidates(tmp_path):
    """`--save` then `--measured`: each candidate gets its saved figures by layout and AC mode;
    one the saved run did not measure reads as not measured."""
    from types import SimpleNamespace

    from tools.plan_check import reuse, save

    def cand(name: str, ac: str = "none"):
        return SimpleNamespace(layout=SimpleNamespace(name=name), ac_mode=ac)

    measured = [cand("ws4-fsdp4"), cand("ws4-tp4")]
    path = str(tmp_path / "m.json")
    save(path, measured, [{0: (0.8, 100), 1: "exit 1"}, {0: (0.9, 120), 1: (1.5, 90)}])
    now = [cand("ws4-tp4"), cand("ws4-fsdp4"), cand("ws4-fsdp4", "full")]
    assert reuse(path, now) == [
        {0: "exit 1", 1: (0.8, 100), 2: "not measured"},
        {0: (1.5, 90), 1: (0.9, 120), 2: "not measured"},
    ]
