"""The pure parts of tools/benchmark_finetune.py: the longest sequence within a memory budget
(a straight line through two measured peaks) and the table's ratios against peft. The tool
itself runs from `python tools/benchmark_finetune.py` (docs/performance.md has its table)."""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
from tools import benchmark_finetune as ft  # noqa: E402

PEFT = "transformers + peft"


def row(name: str, seq: int, step_s: float, peak: float, vocab: int = 32768) -> dict:
    return {"name": name, "seq": seq, "vocab": vocab, "step_s": step_s, "peak_gib": peak}


def test_longest_sequence_is_read_off_the_line_through_two_peaks():
    rows = [row(PEFT, 512, 1.0, 1.0), row(PEFT, 2048, 4.0, 2.5), row("x", 512, 1.0, 1.0)]
    assert ft.longest(rows, PEFT, 32768, 16.0) == "~15,872"  # 512 + 15 GiB / (1.5 / 1536)
    assert ft.longest(rows, "x", 32768, 16.0) == "n/a"  # one point: no line
    assert ft.longest(rows, PEFT, 131072, 16.0) == "n/a"  # another vocabulary


def test_the_table_gives_speed_and_memory_against_peft_of_the_same_work():
    rows = [
        row("titanlab LoRA · fused loss", 2048, 2.0, 1.0),
        row(PEFT, 2048, 3.0, 2.5),
        {"name": "titanlab LoRA · plain loss", "seq": 2048, "vocab": 32768, "error": "boom"},
    ]
    a = argparse.Namespace(cuda=False, threads=2, hidden=512, layers=8, rank=16, steps=3,
                           warmup=1, vocabs=[32768], budget_gib=16.0)  # fmt: skip
    table = ft.render(rows, a, "python tools/benchmark_finetune.py")
    assert "| titanlab LoRA · fused loss | 32,768 | 2048 | 2.000 | 1.50× | 1.00 | 0.40× |" in table
    assert "| titanlab LoRA · plain loss | 32,768 | 2048 | failed: boom | | | |" in table
    assert "peak RSS GiB" in table
