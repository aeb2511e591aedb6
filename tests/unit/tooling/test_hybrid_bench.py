"""tools/benchmark_hybrid.py: measured at seq 128 and 256 (both models, every row timed and
traced), the hybrid keeps fewer bytes per token for backward as the sequence doubles relative
to softmax attention (its linear layers keep no S × S scores), the table renders, and the
crossover line interpolates between the rows where the time ratio crosses 1."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)

from tools import benchmark_hybrid  # noqa: E402


def test_rows_are_measured_and_render():
    rows = benchmark_hybrid.measure([128, 256], repeats=1)
    assert [(r["seq"], r["model"]) for r in rows] == [
        (128, "qwen3_5"), (128, "qwen3"), (256, "qwen3_5"), (256, "qwen3"),
    ]  # fmt: skip
    assert all(r["ms"] > 0 and r["kept"] > 0 for r in rows)
    per_token = {(r["seq"], r["model"]): r["kept"] / r["seq"] for r in rows}
    ratio = [per_token[s, "qwen3_5"] / per_token[s, "qwen3"] for s in (128, 256)]
    assert ratio[1] < ratio[0]
    table = benchmark_hybrid.render(rows, 1)
    assert "| 256 | qwen3 |" in table and "1.00×" in table


def test_the_crossover_is_interpolated_in_log_seq():
    rows = [
        {"seq": 512, "model": "qwen3_5", "ms": 2.0}, {"seq": 512, "model": "qwen3", "ms": 1.0},
        {"seq": 2048, "model": "qwen3_5", "ms": 1.0}, {"seq": 2048, "model": "qwen3", "ms": 2.0},
    ]  # fmt: skip
    assert (
        benchmark_hybrid.crossover(rows) == "The hybrid's step becomes the faster near seq ≈ 1,024."
    )
    slower = [{**r, "ms": 3.0} if r["model"] == "qwen3_5" else r for r in rows]
    assert "stays the slower up to seq 2048" in benchmark_hybrid.crossover(slower)
