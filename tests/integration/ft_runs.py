"""Launching fault-tolerant runs as a user does (`titanlab train` with `[fault_tolerance]`: the
lighthouse and one torchrun per replica group) and reading what each group wrote, for
tests/integration/test_fault_tolerance*.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.integration.conftest import REPO, TINY

GROUP_RANKS = 2
FSDP = ("--parallelism.data_parallel_shard_degree", str(GROUP_RANKS))
"""The layout inside each group unless a test names another: FSDP over its 2 ranks."""


def ft_args(
    dataset: str, dump: str, steps: int, *extra: str, layout: tuple[str, ...] = FSDP
) -> list[str]:
    """A tiny run of `steps` steps on `dataset` into `dump`, each group laid out by `layout`."""
    return [*TINY, "--data.dataset_path", dataset, "--job.dump_folder", dump,
            "--training.steps", str(steps), *layout, *extra]  # fmt: skip


def titanlab_train(args: list[str], env: dict | None = None) -> subprocess.Popen:
    """`titanlab train` with fault tolerance on: the lighthouse and the groups, 2 ranks each
    unless `env` sets NGPU."""
    env = {**os.environ, "NGPU": str(GROUP_RANKS), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", **(env or {})}  # fmt: skip
    env.pop("TORCHFT_LIGHTHOUSE", None)
    cmd = [sys.executable, "-m", "titanlab.cli", "train", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def late_group(group: int, seconds: float, step: int = 0) -> dict[str, str]:
    """The environment (for `titanlab_train`) in which the ranks of replica group `group` are
    `seconds` late (`late_start/sitecustomize.py`): to start (without the first quorum waiting
    for every group, the others would train their first steps alone), or, given `step`, to ask
    for that step's quorum (longer than the lighthouse waits for a live group, the others make
    the step without it)."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "late_start")
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "TITANLAB_TEST_LATE_GROUP": str(group),
            "TITANLAB_TEST_LATE_SECONDS": str(seconds),
            "TITANLAB_TEST_LATE_STEP": str(step)}  # fmt: skip


def finish(run: subprocess.Popen, dump: str) -> str:
    """The run's output once it ends (kept in `<dump>/titanlab_train.log`); it must succeed."""
    out, _ = run.communicate(timeout=600)
    os.makedirs(dump, exist_ok=True)
    with open(os.path.join(dump, "titanlab_train.log"), "w", encoding="utf-8") as f:
        f.write(out)  # kept for diagnosis
    assert run.returncode == 0, out[-6000:]
    return out


def group_metrics_of(folder: str) -> dict[int, dict]:
    """The records of `<folder>/metrics.jsonl` by step (the last of a step)."""
    with open(os.path.join(folder, "metrics.jsonl"), encoding="utf-8") as f:
        return {rec["step"]: rec for rec in map(json.loads, f)}


def group_metrics(dump: str, group: int) -> dict[int, dict]:
    return group_metrics_of(os.path.join(dump, f"replica_{group}"))
