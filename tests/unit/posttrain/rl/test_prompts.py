"""The prompt stream: held-out prompts never drawn, a resumed stream continues exactly, each dp
rank draws its own, and another task's state is refused."""

from __future__ import annotations

import pytest

from titanlab.data.digit_tasks import DigitTask, is_held_out
from titanlab.posttrain.rl.prompts import PromptStream


def test_the_stream_never_draws_a_held_out_prompt_and_resumes_where_it_stopped():
    task = DigitTask("reverse", 4)
    held = {tuple(p) for p, _ in task.held_out_set(64, seed=0)}
    assert len(held) == 64 and all(is_held_out(list(p[1:-1])) for p in held)
    stream = PromptStream(task, seed=0, dp_rank=0)
    first, _ = stream.next(500)
    assert not held & {tuple(p) for p in first}
    state = stream.state_dict()
    after, _ = stream.next(7)
    resumed = PromptStream(task, seed=0, dp_rank=0)
    resumed.load_state_dict(state)
    assert resumed.next(7)[0] == after
    other_rank, _ = PromptStream(task, seed=0, dp_rank=1).next(50)
    assert other_rank != first[:50]  # each dp rank draws its own prompts


def test_resuming_another_tasks_stream_is_refused_in_one_line():
    from titanlab.config.errors import ConfigError

    state = PromptStream(DigitTask("sort", 5), 0, 0).state_dict()
    with pytest.raises(ConfigError, match="task sort of 5 digits, this run's is reverse of 4"):
        PromptStream(DigitTask("reverse", 4), 0, 0).load_state_dict(state)


def test_resuming_against_another_reference_policy_is_refused_in_one_line():
    from titanlab.config.errors import ConfigError

    stream = PromptStream(DigitTask("reverse", 4), 0, 0)
    stream.reference = "seed 0"
    state = stream.state_dict()
    again = PromptStream(DigitTask("reverse", 4), 0, 0)
    again.reference = "/ckpt/base"
    with pytest.raises(
        ConfigError, match="trained against the reference policy seed 0, this run's is /ckpt/base"
    ):
        again.load_state_dict(state)
    again.reference = "seed 0"
    again.load_state_dict(state)
    assert again.drawn == 0
