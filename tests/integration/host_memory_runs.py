"""The trainer's entry point with rank 0 sampling its host memory after steps 20 and 120
(`tools.lib.host_memory.run_sampled`), for tests/integration/test_host_memory.py (warm ranks:
target `host_memory_runs:pool_main`).

argv: OUT (the JSON `run_sampled` writes), then the trainer's options. The sampler's history of
consumed counts is cut to `HISTORY_STEPS` for the job (and put back after it): it keeps one list
per step for its last 4096 steps, so a shorter one is full before the first sample.
"""

from __future__ import annotations

from titanlab.data import mixture
from tools.lib.host_memory import run_sampled

FIRST, LAST = 20, 120
HISTORY_STEPS = 8


def pool_main(argv: list[str]) -> int:
    out, *args = argv
    kept = mixture._HISTORY_STEPS
    mixture._HISTORY_STEPS = HISTORY_STEPS
    try:
        return run_sampled(
            out, (FIRST, LAST), [*args, "--training.steps", str(LAST)], full_collect=True
        )
    finally:
        mixture._HISTORY_STEPS = kept
