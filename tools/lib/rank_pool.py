"""Warm ranks: a pool of worker processes that run one multi-rank job after another.

`fork_launch.fork_run` pays, for every launch, a fork per rank and everything a fresh process
does once: the first torch.compile (Dynamo, AOTAutograd and their lazy imports: ~35 s of CPU
for the debug model on CI's 2 cores, ~3 s once warm), the first fake-tensor trace of the
memory estimate, first-call dispatch caches. `RankPool` keeps its workers alive instead and
sends each a job over a pipe, the way torch's `MultiProcContinuousTest` feeds tests to ranks
spawned once per class and DeepSpeed's `reuse_dist_env` keeps a pool per world size. A worker
is rank r of whatever world the job has (worker i is rank i), so one pool of up to 8 workers
serves 1-, 2-, 4- and 8-rank jobs.

A job is `titanlab.train`'s `main(args)` (or any `module:function` taking the argument list) with
torchrun's environment contract, as `fork_run` gives it: a fresh process group per job
(`main` creates and destroys it; the pool hosts its rendezvous store, as torchrun's agent does), stdout and stderr to
per-rank files, the job's environment, working directory and intra-op thread count.

Between jobs each worker puts back what a job may change in its process (environment, random
states, torch's flags, the compile configs and Dynamo's compiled code, ...) or, where it cannot
(a thread left running, a process group still up), retires: `tools.lib.pool_worker`. A retired
worker is replaced by a fresh fork at the next job.

Failures stay with their job: when a rank fails, the others are stopped as torchrun stops them
(SIGTERM, then SIGKILL after `GRACE_S`) and every worker of the job that did not return by
itself is dropped; a job that runs past its timeout has all its workers killed and raises
`PoolTimeout`, which names each rank's last line of output. The next job gets fresh forks in
their place.

What a warm worker cannot give: its peak resident size (`ru_maxrss`) is its lifetime's, not
the job's, so a test that asserts a run's own peak memory launches with `fork_run`.

Source: PyTorch's `torch/testing/_internal/common_distributed.py` (MultiProcContinuousTest),
the Python docs of `multiprocessing` (forkserver, Connection, `connection.wait`) and torchrun's
environment variables.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from tools.lib import fork_launch
from tools.lib.pool_worker import Job, worker_main

TRAIN_MAIN = "titanlab.train:main"
MAX_WORKERS = 8
"""The largest world a job may have."""
KEEP_WORKERS = 4
"""Workers kept warm after a job; those of higher rank (an 8-rank job's 4-7) are retired."""
GRACE_S = fork_launch.GRACE_S


class PoolTimeout(subprocess.TimeoutExpired):
    """A job ran past its timeout; `str()` names each rank's last line of output."""

    def __str__(self) -> str:
        return super().__str__() + "".join(
            f"\n  rank {r}: {line}" for r, line in enumerate(self.last_lines)
        )

    last_lines: list[str]


@dataclass
class _Worker:
    process: Any
    conn: multiprocessing.connection.Connection


class SpawnFailed(RuntimeError):
    """A rank of `RankPool.spawn` failed; the message has its exit code and last lines."""


class RankPool:
    """Up to `MAX_WORKERS` warm workers forked from `fork_launch`'s preloaded server."""

    def __init__(self) -> None:
        self._workers: list[_Worker | None] = [None] * MAX_WORKERS
        self.started = 0
        """Workers forked so far (a test of the pool reads it)."""
        self.retired: list[str] = []
        """Why each worker that could not be put back was retired."""

    def run(
        self,
        nproc: int,
        args: list[str],
        env: dict[str, str] | None = None,
        timeout: float = 900,
        target: str = TRAIN_MAIN,
        paths: list[str] | None = None,
        spawned: bool = False,
        log_rank: int | None = None,
    ) -> subprocess.CompletedProcess:
        """Run `target(args)` as ranks 0..nproc-1 of a fresh world; `fork_run`'s contract.

        Args:
            nproc: number of ranks, 1 to `MAX_WORKERS` (1 runs with no rank variables set).
            args: the argument list passed to the target (the trainer's options).
            env: the ranks' environment (default: this process's) before the rank variables.
            timeout: seconds before every rank is killed and `PoolTimeout` raised.
            target: "module:function"; the function takes the list and returns an exit code.
            paths: directories put in front of the workers' `sys.path` for this job.
            spawned: call `target(rank, *args)` and count a return as exit code 0.
            log_rank: keep only this rank's stdout (run_train.sh's LOG_RANK); None: all.
        Returns:
            CompletedProcess: returncode 0 or the first failed rank's code (a negative signal
            number for a rank that died), the ranks' stdout and stderr in rank order, stderr
            ending with `rank R exitcode : C` and `rank R last line: ...` per failed rank.
        Raises:
            ValueError: nproc outside 1..MAX_WORKERS. PoolTimeout: the job timed out.
        """
        if not 1 <= nproc <= MAX_WORKERS:
            raise ValueError(f"nproc={nproc}: a pool job has 1 to {MAX_WORKERS} ranks")
        base = dict(os.environ if env is None else env)
        workers = [self._worker(rank) for rank in range(nproc)]
        with contextlib.ExitStack() as job:
            if nproc > 1 and not spawned:
                base.update(job.enter_context(fork_launch.agent_store()))
            logs = job.enter_context(tempfile.TemporaryDirectory(prefix="titanlab-pool-"))
            files = [(os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err"))
                     for r in range(nproc)]  # fmt: skip
            for rank, worker in enumerate(workers):
                rank_env = dict(base)
                if nproc > 1 and not spawned:  # spawn's children get no rank variables
                    rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                    LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0")  # fmt: skip
                job = Job(target, list(args), rank_env, *files[rank], paths or [], rank, spawned)
                worker.conn.send(job)
            try:
                codes, first = self._wait(workers, timeout)
            except PoolTimeout as e:
                e.output, e.stderr = fork_launch._read_logs(logs, nproc)
                e.last_lines = [_last_line(out, err) for out, err in files]
                raise
            outs, errs = fork_launch._read_logs(logs, nproc, log_rank)
            failed = [r for r, c in enumerate(codes) if c]
            tail = "".join(f"rank {r} exitcode : {codes[r]}\n" for r in failed)
            tail += "".join(f"rank {r} last line: {_last_line(*files[r])}\n" for r in failed)
        return subprocess.CompletedProcess(args, first, outs, errs + tail)

    def spawn(self, fn: Any, args: tuple, nprocs: int, timeout: float = 600) -> None:
        """`torch.multiprocessing.spawn(fn, args, nprocs)` on warm workers: `fn(rank, *args)`
        on ranks 0..nprocs-1, with this process's environment. `fn` is a module-level function;
        its module is imported in the workers from its file's folder, as spawn's children do.

        Raises:
            SpawnFailed: a rank raised or died (its traceback is in the message).
            PoolTimeout: the ranks ran past `timeout` seconds.
        """
        module = sys.modules[fn.__module__]
        folder = os.path.dirname(os.path.abspath(module.__file__ or ""))
        name = module.__spec__.name if module.__spec__ else fn.__module__
        proc = self.run(nprocs, list(args), timeout=timeout, target=f"{name}:{fn.__qualname__}",
                        paths=[folder], spawned=True)  # fmt: skip
        if proc.returncode:
            raise SpawnFailed(f"{fn.__qualname__} failed ({proc.returncode}):\n"
                              f"{proc.stdout[-2000:]}{proc.stderr[-6000:]}")  # fmt: skip

    def close(self) -> None:
        """Stop every worker (they also exit by themselves when this process ends)."""
        for rank in range(MAX_WORKERS):
            self._retire(rank, signal.SIGKILL)

    def _worker(self, rank: int) -> _Worker:
        worker = self._workers[rank]
        if worker is None or worker.process.exitcode is not None:
            ctx = fork_launch._context()
            parent, child = ctx.Pipe()
            process = ctx.Process(target=worker_main, args=(child,), daemon=True)
            process.start()
            child.close()
            worker = self._workers[rank] = _Worker(process, parent)
            self.started += 1
        return worker

    def _wait(self, workers: list[_Worker], timeout: float) -> tuple[list[int], int]:
        """(each rank's exit code, the first failure's code or 0); the first failure stops the
        rest, whose workers are dropped with every worker that did not come back clean."""
        deadline = time.monotonic() + timeout
        codes: list[int | None] = [None] * len(workers)
        clean = [False] * len(workers)
        first = 0
        while any(c is None for c in codes):
            if time.monotonic() > deadline:
                for rank, code in enumerate(codes):
                    if code is None:
                        self._retire(rank, signal.SIGKILL)
                raise PoolTimeout([w.process.name for w in workers], timeout)
            waiting = {}
            for rank, w in enumerate(workers):
                if codes[rank] is None:
                    waiting[w.conn] = rank
                    waiting[w.process.sentinel] = rank
            for ready in multiprocessing.connection.wait(list(waiting), 0.5):
                rank = waiting[ready]
                if codes[rank] is not None:
                    continue
                codes[rank], clean[rank] = self._collect(rank)
                if codes[rank] and not first:
                    first = codes[rank]
                    self._stop_others(codes)
        for rank in range(len(workers)):
            if not (clean[rank] and rank < KEEP_WORKERS):
                self._retire(rank, signal.SIGKILL)
        return [c or 0 for c in codes], first

    def _collect(self, rank: int) -> tuple[int, bool]:
        worker = self._workers[rank]
        assert worker is not None
        try:
            if worker.conn.poll():
                code, dirty = worker.conn.recv()
                if dirty:
                    self.retired.append(f"rank {rank}: {dirty}")
                return code, dirty is None
        except (EOFError, OSError):
            pass
        worker.process.join(5)
        exitcode = worker.process.exitcode
        return (exitcode if exitcode else 1), False  # it died (a signal, os._exit)

    def _stop_others(self, codes: list[int | None]) -> None:
        """SIGTERM to the ranks still running, SIGKILL to those left after `GRACE_S`; none of
        them is reused (stopped mid-job)."""
        running = [r for r, c in enumerate(codes) if c is None]
        for rank in running:
            self._signal(rank, signal.SIGTERM)
        stop_at = time.monotonic() + GRACE_S
        while any(codes[r] is None for r in running) and time.monotonic() < stop_at:
            for rank in running:
                worker = self._workers[rank]
                assert worker is not None
                if codes[rank] is None and (worker.conn.poll() or not self._alive(rank)):
                    codes[rank], _ = self._collect(rank)
            time.sleep(0.05)
        for rank in running:
            if codes[rank] is None:
                codes[rank] = -signal.SIGKILL
            self._retire(rank, signal.SIGKILL)

    def _alive(self, rank: int) -> bool:
        worker = self._workers[rank]
        return worker is not None and worker.process.exitcode is None

    def _signal(self, rank: int, sig: int) -> None:
        worker = self._workers[rank]
        if worker is not None and worker.process.exitcode is None:
            try:
                os.kill(worker.process.pid, sig)
            except ProcessLookupError:
                pass

    def _retire(self, rank: int, sig: int) -> None:
        worker = self._workers[rank]
        if worker is None:
            return
        self._signal(rank, sig)
        worker.process.join(10)
        worker.conn.close()
        self._workers[rank] = None


def _last_line(out: str, err: str) -> str:
    """The last non-empty line a rank wrote (stderr first: a traceback's last line)."""
    for path in (err, out):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        except OSError:
            continue
        if lines:
            return lines[-1][:300]
    return "(no output)"


_POOL: RankPool | None = None


def default_pool() -> RankPool:
    """This process's pool (made at first use, closed at exit)."""
    global _POOL
    if _POOL is None:
        _POOL = RankPool()
        atexit.register(_POOL.close)
    return _POOL


def warm_run(
    nproc: int,
    args: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 900,
    log_rank: int | None = None,
) -> subprocess.CompletedProcess:
    """`titanlab.train` on `nproc` warm ranks of `default_pool()` (`RankPool.run`), or, with
    TITANLAB_WARM_RANKS=0 in this process's environment, on fresh forks (`fork_run`);
    `log_rank`: only that rank's stdout."""
    if os.environ.get("TITANLAB_WARM_RANKS", "1") == "0":
        return fork_launch.fork_run(nproc, args, env=env, timeout=timeout, log_rank=log_rank)
    return default_pool().run(nproc, args, env=env, timeout=timeout, log_rank=log_rank)
