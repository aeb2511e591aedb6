"""The run summary names the share of FlexAttention's tiles each layer kind computed, counted by
`flex_masks.TileCounter` over the masks a run built (on the device: no host sync until the
summary reads them), and says nothing of it where no FlexAttention ran."""

from __future__ import annotations

import torch

from titanlab.metrics.logger import MetricsLogger
from titanlab.models.common.flex_masks import TileCounter, band_block_mask, kind_of
from titanlab.observability.run_summary import format_summary


def summary(tiles) -> str:
    metrics = MetricsLogger(device=torch.device("cpu"), rank=0, log_freq=1, tokens_per_step=8,
                            samples_per_step=1, world_size=1, flops_per_token=1,
                            peak_flops=None)  # fmt: skip
    return format_summary(first_step=0, last_step=2, wall_s=3.0, metrics=metrics,
                          memory_kind="CPU RSS", checkpoint=None, plot="off", traces=None,
                          attention_tiles=tiles)  # fmt: skip


def test_the_counter_sums_each_kinds_tiles_and_the_summary_prints_them():
    counter = TileCounter()
    cpu = torch.device("cpu")
    for _ in range(2):  # two forwards of a model with full and sliding layers, 1024 tokens
        counter.add(kind_of(None), band_block_mask(1024, 1024, None, cpu))
        counter.add(kind_of(128), band_block_mask(1024, 1024, 128, cpu))
    fractions = counter.fractions()
    assert fractions == {"full": 36 / 64, "window 128": 15 / 64}
    line = next(x for x in summary(fractions).splitlines() if "attention:" in x)
    assert "full 56.2%" in line and "window 128 23.4%" in line
    assert "attention:" not in summary({})


def test_fake_masks_are_not_counted():
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter = TileCounter()
    with FakeTensorMode():
        counter.add("full", band_block_mask(1024, 1024, None, torch.device("cpu")))
    assert counter.fractions() == {}
