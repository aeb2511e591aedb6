"""Command-line overrides for a tiny CPU run of the debug model, shared by tests and tools.

`TINY_RUN` is what every small end-to-end run uses: the debug model's config, 64-token windows,
a 2-step warmup, a loss line every step, no validation, deterministic kernels and 120 s
process-group timeouts (a hung rank fails fast). `CONSTANT_LR` makes the learning rate not
depend on `training.steps` (2 warmup steps, then constant), so a 10-step run resumed to 20 steps
follows the same schedule as a 20-step run.
"""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG_CONFIG = os.path.join(REPO, "train_configs", "debug_model.toml")

TINY_RUN = [
    "--job.config_file",
    DEBUG_CONFIG,
    "--training.seq_len",
    "64",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "false",
    "--debug.deterministic",
    "true",
    "--comm.init_timeout_seconds",
    "120",
    "--comm.train_timeout_seconds",
    "120",
]

CONSTANT_LR = ["--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0"]


def checkpoint_every(interval: int, *extra: str) -> list[str]:
    """Overrides that save a checkpoint every `interval` steps and no HF export at the end."""
    return [
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        str(interval),
        "--checkpoint.export_at_end",
        "false",
        *extra,
    ]
