"""components.batch_layout: global batch → gradient accumulation steps."""

import pytest

from titanlab.components.builders import batch_layout
from titanlab.config.job_config import ConfigError, JobConfig


def config(local: int, global_bs: int) -> JobConfig:
    c = JobConfig()
    c.training.local_batch_size, c.training.global_batch_size = local, global_bs
    return c


@pytest.mark.parametrize(
    "local, global_bs, dp, expected",
    [
        (8, -1, 2, (8, 16, 2, 1)),
        (8, 16, 2, (8, 16, 2, 1)),
        (8, 64, 2, (8, 64, 2, 4)),
        (4, 12, 1, (4, 12, 1, 3)),
        (1, -1, 1, (1, 1, 1, 1)),
    ],
)
def test_grad_accum_steps(local, global_bs, dp, expected):
    layout = batch_layout(config(local, global_bs), dp)
    assert (
        layout.local_batch_size,
        layout.global_batch_size,
        layout.dp_degree,
        layout.grad_accum_steps,
    ) == expected


@pytest.mark.parametrize("global_bs", [24, 8])
def test_non_divisible_global_batch(global_bs):
    with pytest.raises(ConfigError) as info:
        batch_layout(config(8, global_bs), 2)
    assert str(info.value) == (
        f"training.global_batch_size={global_bs} is not divisible by local_batch_size × dp "
        "= 8 × 2 = 16; use a multiple of 16"
    )
