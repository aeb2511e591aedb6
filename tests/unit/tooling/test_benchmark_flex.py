"""tools/benchmark_flex.py: each row's inputs (the block mask's tile share at the row's shape:
documents under the causal half, gpt-oss's window about 2W/S) and the table it writes, an
out-of-memory side named in its cells."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
from tools import benchmark_flex
from titanlab.models.common.flex_masks import computed_fraction


def test_rows_build_their_masks_and_the_table_names_each_figure():
    cpu = torch.device("cpu")
    shares = {name: computed_fraction(benchmark_flex.inputs(row, 1024, cpu)[4])
              for name, row in benchmark_flex.ROWS.items()}  # fmt: skip
    assert shares["gpt-oss 20b · window 128 + sinks"] == 15 / 64  # the tile and the one before
    assert shares["gpt-oss 20b · full + sinks"] == 36 / 64
    assert shares["Llama 3 8B · documents"] < 36 / 64  # documents of 300, 2000, ... tokens
    results = [
        {"row": "a", "seq": 8192, "tiles": 0.5, "flex": {"s": 0.002, "peak_bytes": 2**21},
         "sdpa": {"s": 0.004, "peak_bytes": 2**22}},
        {"row": "b", "seq": 32768, "tiles": 0.03, "flex": {"s": 0.01, "peak_bytes": 2**20},
         "sdpa": {"error": "out of memory"}},
    ]  # fmt: skip
    text = benchmark_flex.table(results, "H200")
    assert "| a | 8,192 | 50.0% | 2.0 | 4.0 | 2.00× | 2.0 | 4.0 |" in text
    assert "| b | 32,768 | 3.0% | 10.0 | out of memory | – | 1.0 | out of memory |" in text
