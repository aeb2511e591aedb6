"""The forked launcher of tests and tools handles a failed or hung rank as torchrun does (its
runs equal torchrun's: tests/integration/test_forked_ranks.py)."""

import multiprocessing
import os
import subprocess
import time

import pytest

from tools.lib import fork_launch


def _sleep_then_exit(seconds: float, code: int) -> None:
    time.sleep(seconds)
    os._exit(code)


def test_the_first_failed_rank_stops_the_others_and_gives_the_exit_code():
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_sleep_then_exit, args=(60, 0)),
             ctx.Process(target=_sleep_then_exit, args=(0.2, 3))]  # fmt: skip
    for p in procs:
        p.start()
    start = time.monotonic()
    assert fork_launch._wait(procs, timeout=30, cmd=["x"]) == 3
    assert time.monotonic() - start < fork_launch.GRACE_S + 5
    assert procs[0].exitcode == -15  # SIGTERM from the launcher, not its own exit


def test_a_launch_past_its_timeout_is_killed_and_raises():
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_sleep_then_exit, args=(60, 0))]
    procs[0].start()
    with pytest.raises(subprocess.TimeoutExpired):
        fork_launch._wait(procs, timeout=0.5, cmd=["x"])
    procs[0].join(5)
    assert procs[0].exitcode == -9


def _threads_after(env: dict[str, str], out) -> None:
    fork_launch._apply_thread_count(env)
    import torch

    out.send(torch.get_num_threads())


def test_a_forked_rank_gets_the_threads_its_environment_asks_for():
    """OMP_NUM_THREADS given to a rank after the fork sets its intra-op threads (OpenMP read
    the parent's environment at import); 3 differs from the parent's 1 (CI) or cores."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_threads_after, args=({"OMP_NUM_THREADS": "3"}, send))
    proc.start()
    assert recv.recv() == 3
    proc.join(10)
