"""`parallelism.expert_capacity_factor`: 0 (the exact exchange) by default; a negative factor,
or a factor without expert parallel, is one line before launch naming the value."""

from __future__ import annotations

import pytest

from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config

P = "--parallelism."


def test_the_exact_exchange_is_the_default():
    assert build_config([]).parallelism.expert_capacity_factor == 0.0


@pytest.mark.parametrize(
    "args, words",
    [
        ([P + "expert_capacity_factor", "-1", P + "expert_parallel_degree", "2"], "must be >= 0"),
        ([P + "expert_capacity_factor", "1.25"], "needs expert_parallel_degree > 1"),
    ],
)
def test_a_factor_it_cannot_take_is_one_line(args, words):
    with pytest.raises(ConfigError) as err:
        build_config(args).validate()
    message = str(err.value)
    assert "\n" not in message and "expert_capacity_factor=" in message and words in message
