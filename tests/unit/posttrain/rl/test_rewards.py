"""Reward functions: the built-ins' values, loading by name, and one line for a bad one."""

from __future__ import annotations

import pytest

from titanlab.config.errors import ConfigError
from titanlab.posttrain.rl.rewards import (
    RewardSet,
    ends_with_eos,
    exact_match,
    load_reward,
    matches_format,
    partial_credit,
)


def meta(finished: bool = True, **extra) -> dict:
    return {"answer": "4321", "finished": finished, **extra}


def test_partial_credit_counts_right_positions_and_stopping_right_after():
    assert partial_credit("", "4321", meta()) == 1.0
    assert partial_credit("", "4391", meta()) == 0.8
    assert partial_credit("", "43", meta()) == 0.4  # stopped early
    assert partial_credit("", "4321", meta(finished=False)) == 0.8  # never stopped
    assert partial_credit("", "12345", meta(finished=False)) == 0.0
    assert exact_match("", "4321", meta()) == 1.0
    assert exact_match("", " 4321\n", meta()) == 1.0  # surrounding whitespace ignored
    assert exact_match("", "4321", meta(finished=False)) == 0.0  # no EOS: not the answer
    assert ends_with_eos("", "4", meta()) == 1.0 and ends_with_eos("", "43", meta(False)) == 0.0


def test_partial_credit_on_text_equals_the_share_of_target_tokens_on_a_digit_task():
    """The digit vocabulary decodes one character per id, so the text reward is the token one:
    the share of the target's tokens (EOS included) sampled at the right position."""
    from titanlab.data.digit_tasks import BOS, EOS, DigitVocab

    vocab, target = DigitVocab(), [4, 3, 2, 1, EOS]
    for ids in ([4, 3, 2, 1, EOS], [4, BOS, 2, 1, EOS], [4, 3, EOS], [1, 2, 3, 4, 5], [14, 3]):
        finished = EOS in ids
        text = vocab.decode(ids[: ids.index(EOS)] if finished else ids)
        by_token = sum(a == b for a, b in zip(ids, target)) / len(target)
        assert partial_credit("", text, meta(finished)) == by_token


def test_the_format_reward_matches_the_whole_completion():
    from titanlab.config.rl import R1_FORMAT

    good = "<think>\n3 + 4 is 7\n</think>\n<answer>7</answer>"
    assert matches_format("", good, meta(format_pattern=R1_FORMAT)) == 1.0
    assert matches_format("", good + " ok", meta(format_pattern=R1_FORMAT)) == 0.0
    assert matches_format("", "<answer>7</answer>", meta(format_pattern=R1_FORMAT)) == 0.0


@pytest.mark.parametrize(
    ("completion", "answer", "right"),
    [
        ("The answer is \\boxed{42}.", "42", 1.0),
        ("so it is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("<think>2 or 3?</think><answer>12</answer>", "12", 1.0),
        ("<answer>\\frac{3}{6}</answer>", "\\frac{1}{2}", 1.0),
        ("I think it is 7", "8", 0.0),
        ("no idea", "3", 0.0),
    ],
)
def test_the_math_answer_checker_compares_by_value(completion, answer, right):
    pytest.importorskip("math_verify")
    from titanlab.posttrain.rl.math_reward import math_answer

    assert math_answer("", completion, meta(answer=answer)) == right


def bad_type(prompt, completion, metadata):
    return "1.0"


def bad_value(prompt, completion, metadata):
    return float("nan")


def test_weighted_sum_and_per_function_scores():
    rewards = RewardSet(
        [f"{partial_credit.__module__}:partial_credit", f"{exact_match.__module__}:exact_match"],
        [0.5, 2.0],
    )
    total, per_fn = rewards.score(["p", "p"], ["4321", "4000"], [meta(), meta()])
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


def bad_raise(prompt, completion, metadata):
    return float(metadata["no_such_field"])


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        ("bad_type", "returned '1.0' (str); a reward function must return a finite float"),
        ("bad_value", "returned nan (float); a reward function must return a finite float"),
        ("bad_raise", "raised KeyError: 'no_such_field' (on the completion '2')"),
    ],
)
def test_a_reward_returning_a_non_number_or_raising_is_one_line(fn, says):
    rewards = RewardSet([f"{__name__}:{fn}"], [])
    with pytest.raises(ConfigError) as e:
        rewards.score(["1"], ["2"], [meta()])
    assert f"rl.rewards[0]='{__name__}:{fn}' {says}" == str(e.value)
