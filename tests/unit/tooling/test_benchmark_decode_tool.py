"""tools/benchmark_decode.py: a row times real generation and the table shows it."""

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)
from titanlab.models.llama3 import llama3_flavors
from titanlab.models.registry import build_model
from tools import benchmark_decode


def test_row_and_table():
    args = dataclasses.replace(
        llama3_flavors["debugmodel"], dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=50,
        max_seq_len=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    row = benchmark_decode.time_row(model.eval(), 2, False, prompt_len=4, new=5, repeats=2)
    assert row["batch"] == 2 and row["compiled"] is False
    assert row["tps"] > 0 and row["ms_per_token"] > 0
    assert row["tps"] * row["ms_per_token"] / 1000 == pytest.approx(2)
    text = benchmark_decode.table([row], "Machine: x")
    assert text.splitlines()[0] == "Machine: x"
    assert text.splitlines()[-1].startswith("| 2 | no | ")
