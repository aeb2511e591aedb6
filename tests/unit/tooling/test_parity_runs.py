"""tools/lib/parity_runs.py's choice of blocks: a layout trains the fewest of the flavor's blocks
that give each pipeline stage one and keep the family's block kinds, and the whole flavor where
that is all of it or the options set the blocks themselves."""

from __future__ import annotations

import pytest

from titanlab.planning.layouts import Layout
from tools.lib.parity_runs import least_blocks

QWEN3_5 = ("--model.name", "qwen3_5")


@pytest.mark.parametrize(
    "layout, extra, blocks",
    [
        (Layout(1, 2, 2, 1, None, 1), (), 2),  # no pipeline: the 2 a layout needs at least
        (Layout(1, 1, 1, 2, "1F1B", 1), (), 2),  # one stage a rank
        (Layout(1, 1, 1, 2, "Interleaved1F1B", 1), (), 4),  # 2 looped stages a rank
        (Layout(1, 1, 1, 2, "ZBVZeroBubble", 1), (), 4),  # a V: 2 stages a rank
        (Layout(1, 1, 1, 4, "1F1B", 1), (), 4),
        (Layout(1, 1, 1, 4, "Interleaved1F1B", 1), (), None),  # 8 stages: the whole flavor
        (
            Layout(1, 1, 1, 2, "LoopedBFS", 1),
            ("--parallelism.pipeline_parallel_stages_per_rank", "3"),
            6,
        ),
        (Layout(1, 2, 1, 1, None, 1), QWEN3_5, 4),  # its 4th block is the first full-attention one
        (Layout(1, 2, 1, 1, None, 1), ("--model.n_layers", "3"), None),  # the options choose
        (Layout(1, 2, 1, 1, None, 1), ("--model.flavor", "debugmodel_tiny"), None),  # 2 of 2
    ],
)
def test_a_layout_trains_the_fewest_blocks_its_stages_and_family_need(layout, extra, blocks):
    assert least_blocks(layout, extra) == blocks
