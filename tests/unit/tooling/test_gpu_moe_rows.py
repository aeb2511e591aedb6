"""tools/gpu_moe_rows.py, the GPU session's MoE rows: every row is a valid one-GPU command of
Qwen3-30B-A3B's 4 blocks (its experts whole, no expert parallel), the ledger predicts each on
CPU, and the table sets a measured row beside its prediction."""

from __future__ import annotations

import tempfile

import pytest

from titanlab.config.manager import build_config
from tools import gpu_moe_rows as moe


@pytest.mark.parametrize("row", moe.ROWS, ids=[r.name for r in moe.ROWS])
def test_every_row_is_a_valid_one_gpu_command(row):
    with tempfile.TemporaryDirectory() as dump:
        config = build_config(moe.trainer_args(row, dump, 3))
    config.validate()
    assert (config.model.name, config.model.flavor, config.model.n_layers) == (
        "qwen3_moe", "30B-A3B", moe.BLOCKS)  # fmt: skip
    p = config.parallelism
    assert (p.data_parallel_shard_degree, p.expert_parallel_degree) == (1, 1)
    assert config.training.seq_len == 4096 and config.training.steps == 3


@pytest.mark.xdist_group("ledger")
def test_the_ledger_predicts_a_row_and_the_table_sets_it_beside_the_measured_step():
    row = moe.ROWS[0]
    led = moe.predict(row, "h100")
    assert 0.01 < led["step_s"] < 10 and 0 < led["mfu"] < 1
    measured = {"median_step_s": led["step_s"] * 2, "tps": 1000.0, "mfu": 0.2}
    text = moe.table([{"row": row.name, "ledger": led, "measured": measured}])
    assert f"| {row.name} | {led['step_s'] * 2e3:.1f} | 1000 | 20.0% |" in text
    assert text.rstrip().endswith("| 0.50 |")  # the ledger predicted half the measured step
