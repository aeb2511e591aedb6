"""Running the trainer from tools and tests: the overrides of a tiny CPU run, a launch (ranks
forked from a preloaded server, or torchrun), its losses, and the line of a failed launch that
says why.

`TINY_RUN` is what every small end-to-end run uses: the debug model's config, 64-token windows,
a 2-step warmup, a loss line every step, no validation, deterministic kernels, 120 s
process-group timeouts (a hung rank fails fast) and no loss.png at the end (drawing it is ~1 s
of a 7 s run; the observability tests ask for it). `CONSTANT_LR` makes the learning rate not
depend on `training.steps` (2 warmup steps, then constant), so a 10-step run resumed to 20 steps
follows the same schedule as a 20-step run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    "--metrics.save_plot",
    "false",
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


def failure_line(log: str, limit: int = 300) -> str:
    """The line of a failed launch's output that says why it failed.

    The first line naming an error wins: under torchrun the rank that fails first prints the
    cause, and the other ranks then fail on broken connections. torchrun's own summary
    (`ChildFailedError`) is skipped, since it only says that a rank failed. Without an error
    line, the last line that is not a banner of `=` or `-` is returned, cut to `limit` chars.
    """
    lines = [ln.strip() for ln in log.splitlines() if ln.strip() and set(ln.strip()) - set("=-")]
    hits = [ln for ln in lines if ("Error" in ln or "error:" in ln) and "ChildFailed" not in ln]
    return (hits[0] if hits else (lines or ["(no output)"])[-1])[:limit]


def launch_command(nproc: int, target: list[str]) -> list[str]:
    """The command that runs `target` (`["-m", "titanlab.train"]` or `[script.py]`) on `nproc`
    ranks: torchrun (standalone rendezvous) for several, plain `python` for one, the documented
    single-process launch (torchrun's own agent adds ~1.8 s of start and exit to a 1-process
    run)."""
    if nproc == 1:
        return [sys.executable, *target]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *target]  # fmt: skip


def launch(
    nproc: int, args: list[str], timeout: int = 900, torchrun: bool = False
) -> subprocess.CompletedProcess:
    """`titanlab.train` on `nproc` ranks (gloo on CPU), one intra-op thread per rank: on the
    warm workers of `tools.lib.rank_pool` (torchrun's environment without its agent), or with
    `torchrun` as a user launches it (`launch_command`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not torchrun:
        from tools.lib.rank_pool import warm_run

        return warm_run(nproc, args, env=env, timeout=timeout)
    cmd = launch_command(nproc, ["-m", "titanlab.train", *args])
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def read_losses(dump: str) -> dict[int, float]:
    """Losses by step from `<dump>/metrics.jsonl` (the last record of a step wins)."""
    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as f:
        return {rec["step"]: rec["loss"] for rec in map(json.loads, f)}
