"""`parallelism.expert_capacity_factor`: 0 (the exact exchange) by default; a negative factor,
or a factor without expert parallel, is one line before launch naming the value. So is
`parallelism.expert_dispatch_chunks` (1 by default) below 1, or above 1 without a capacity."""

from __future__ import annotations

import pytest

from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config

P = "--parallelism."


def test_the_exact_exchange_is_the_default():
    assert build_config([]).parallelism.expert_capacity_factor == 0.0
    assert build_config([]).parallelism.expert_dispatch_chunks == 1


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


EP2 = [P + "expert_parallel_degree", "2"]


@pytest.mark.parametrize(
    "args",
    [
        [P + "expert_dispatch_chunks", "2", *EP2],  # the exact exchange
        [P + "expert_dispatch_chunks", "0", P + "expert_capacity_factor", "1.25", *EP2],
    ],
)
def test_chunks_it_cannot_take_are_one_line(args):
    with pytest.raises(ConfigError) as err:
        build_config(args).validate()
    message = str(err.value)
    assert "\n" not in message and "expert_dispatch_chunks=" in message
    assert "with expert_capacity_factor > 0" in message
    ok = [P + "expert_dispatch_chunks", "2", P + "expert_capacity_factor", "1.25", *EP2]
    build_config(ok).validate()
