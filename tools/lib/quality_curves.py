"""Validation-loss curves of training runs, read from their `metrics.jsonl`, and the tokens and
seconds each takes to a target loss: what the quality benchmarks compare (time and tokens to
the same validation loss, not the loss at a fixed step)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


@dataclass
class Curve:
    """One run: validation losses by step, cumulative training seconds by step, tokens/step."""

    optimizer: str
    lr: float
    tokens_per_step: int
    val: dict[int, float] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    step_ms: list[float] = field(default_factory=list)

    @property
    def final(self) -> float:
        return self.val[max(self.val)]


def read_curve(dump: str, optimizer: str, lr: float, groups: int = 1) -> Curve:
    """The curve of a run from its `metrics.jsonl` (a record per logged window: the window's
    steps × its mean step time add to the training seconds). `groups`: replica groups of a
    fault-tolerant run (`dump` is one group's folder; the job's tokens per step are that
    many times the group's)."""
    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    curve = Curve(optimizer, lr, records[0]["tokens_per_step"] * groups)
    total = 0.0
    for rec in records:
        total += rec["steps_in_window"] * rec["step_time_ms"] / 1000
        curve.seconds[rec["step"]] = total
        curve.step_ms.append(rec["step_time_ms"])
        if "val_loss" in rec:
            curve.val[rec["step"]] = rec["val_loss"]
    return curve


def to_target(curve: Curve, target: float) -> tuple[int, float] | None:
    """(tokens, training seconds) at the first validation at or below `target`; None if never."""
    for step in sorted(curve.val):
        if curve.val[step] <= target:
            return step * curve.tokens_per_step, curve.seconds[step]
    return None
