"""Curves of one or more runs from their `metrics.jsonl`, drawn to one PNG (matplotlib).

Four panels against step: train loss (validation loss dashed, same colour), tokens/s per rank,
memory (GiB, the log line's headline figure) and gradient norm; for a reinforcement-learning run,
the mean reward (the greedy held-out exact match dashed), the KL to the reference, tokens/s and
gradient norm. One colour per run, with a legend naming each run by its folder. matplotlib is an optional extra (`pip install 'titanlab[plot]'`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

PANELS = (
    ("loss", "loss"),
    ("tps", "tokens/s per rank"),
    ("memory_gib", "memory (GiB)"),
    ("grad_norm", "grad norm"),
)
# A reinforcement-learning run: its loss is a surrogate, the rewards show the progress (the
# greedy held-out exact match dashed on the reward panel).
RL_PANELS = (
    ("rl/reward_mean", "reward (sampled completions)"),
    ("rl/kl", "KL to the reference"),
    ("tps", "tokens/s per rank"),
    ("grad_norm", "grad norm"),
)
WIDTH_PX, HEIGHT_PX, DPI = 1600, 1000, 100


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of `<run_dir>/metrics.jsonl` in file order, the last record of a step winning.

    Raises:
        ValueError: the file does not exist (one line naming it).
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist; pass a run's dump folder (job.dump_folder)")
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a partial last line of a killed run
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold `key`."""
    pairs = [(r["step"], float(r[key])) for r in records if key in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_runs(run_dirs: list[str], out_path: str, labels: list[str] | None = None) -> Any:
    """Draw the runs' curves to `out_path` (PNG, WIDTH_PX × HEIGHT_PX); returns the Figure.

    Raises:
        ValueError: matplotlib is missing, or a run folder has no metrics.jsonl (one line).
    """
    try:
        import matplotlib

        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache notes
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plotting needs matplotlib; pip install 'titanlab[plot]'") from None
    runs = [read_metrics(d) for d in run_dirs]
    labels = labels or [os.path.basename(os.path.abspath(d)) for d in run_dirs]
    fig, axes = plt.subplots(2, 2, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    rl = any("rl/reward_mean" in r for records in runs for r in records)
    for ax, (key, title) in zip(axes.flat, RL_PANELS if rl else PANELS):
        for i, (records, label) in enumerate(zip(runs, labels)):
            color = f"C{i % 10}"
            ax.plot(*series(records, key), color=color, label=label)
            dashed = {"loss": ("val_loss", "val"), "rl/reward_mean": ("rl/eval_exact_match",
                      "held-out exact match")}.get(key)  # fmt: skip
            if dashed and any(dashed[0] in r for r in records):
                steps, val = series(records, dashed[0])
                ax.plot(steps, val, color=color, linestyle="--", marker="o",
                        label=f"{label} ({dashed[1]})")  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=DPI)
    plt.close(fig)
    return fig
