"""Reward functions: the built-ins' values, loading by name, and one line for a bad one."""

from __future__ import annotations

import pytest

from titanlab.config.errors import ConfigError
from titanlab.data.digit_tasks import EOS
from titanlab.posttrain.rl.rewards import (
    RewardSet,
    ends_with_eos,
    exact_match,
    load_reward,
    partial_credit,
)

META = {"target": [4, 3, 2, 1, EOS]}


def test_partial_credit_counts_right_positions_eos_included():
    assert partial_credit([], [4, 3, 2, 1, EOS], META) == 1.0
    assert partial_credit([], [4, 3, 9, 1, EOS], META) == 0.8
    assert partial_credit([], [4, 3, EOS], META) == 0.4  # stopped early
    assert partial_credit([], [1, 2, 3, 4, 5], META) == 0.0
    assert exact_match([], [4, 3, 2, 1, EOS], META) == 1.0
    assert exact_match([], [4, 3, 2, 1], META) == 0.0  # no EOS: not the answer
    assert ends_with_eos([], [4, EOS], META) == 1.0 and ends_with_eos([], [4, 3], META) == 0.0


def bad_type(prompt, completion, metadata):
    return "1.0"


def bad_value(prompt, completion, metadata):
    return float("nan")


def test_weighted_sum_and_per_function_scores():
    rewards = RewardSet(
        [f"{partial_credit.__module__}:partial_credit", f"{exact_match.__module__}:exact_match"],
        [0.5, 2.0],
    )
    total, per_fn = rewards.score([[1], [1]], [[4, 3, 2, 1, EOS], [4, 0, 0, 0, EOS]], [META] * 2)
    assert per_fn["partial_credit"].tolist() == pytest.approx([1.0, 0.4])
    assert per_fn["exact_match"].tolist() == [1.0, 0.0]
    assert total.tolist() == pytest.approx([0.5 + 2.0, 0.2])


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("partial_credit", "must be `module:function`"),
        ("no_such_module_xyz:f", "cannot be imported: ModuleNotFoundError"),
        ("titanlab.posttrain.rl.rewards:nothing", "has no function nothing"),
    ],
)
def test_a_reward_that_cannot_be_loaded_is_one_line_naming_it(spec, says):
    with pytest.raises(ConfigError) as e:
        load_reward(spec, 2)
    assert f"rl.rewards[2]={spec!r}" in str(e.value) and says in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fn", ["bad_type", "bad_value"])
def test_a_reward_returning_a_non_number_is_one_line(fn):
    rewards = RewardSet([f"{__name__}:{fn}"], [])
    with pytest.raises(
        ConfigError,
        match=rf"rl.rewards\[0\]='{__name__}:{fn}' returned .* must return a finite float",
    ):
        rewards.score([[1]], [[2]], [META])
