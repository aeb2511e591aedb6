"""Launching `titanlab.train` ranks from a process that has already imported it (tests and tools).

A torchrun launch costs, before the first step, one import of torch in the agent and one import
of titanlab.train (~2 s of CPU) in every rank; on CI's 2 cores an 8-rank parity run spent a third
of its time there. `fork_run` starts each rank as a fork of a forkserver process
(`multiprocessing`'s "forkserver" context, with titanlab.train preloaded), so the imports are
paid once per test process. The server has run no tensor operation and holds no thread pool or
process group, so a fork of it starts as clean as a fresh interpreter.

Each rank gets torchrun --standalone's environment contract: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT, the rendezvous store hosted by the
launching process as torchrun's agent hosts it (`agent_store`). Like torchrun, the first rank
that fails stops the others (SIGTERM, then SIGKILL after `GRACE_S`), and the launch returns that
rank's exit code. The launcher itself (restarts, signals to the agent, its one-line summary) is
tested through torchrun: tests of launching use `tools.lib.runs.launch_command`. As with any
forkserver start, a script that calls `fork_run` must keep its entry point under
`if __name__ == "__main__":` (each rank imports the main module again; the Python docs' "Safe
importing of main module").

Source: the Python docs of `multiprocessing` (contexts and start methods, `set_forkserver_preload`)
and of torchrun's environment variables (PyTorch "torchrun (Elastic Launch)").
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRACE_S = 3.0
"""Seconds the other ranks get to exit after one fails, before SIGKILL."""

_CONTEXT: multiprocessing.context.ForkServerContext | None = None


def _context() -> multiprocessing.context.ForkServerContext:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["titanlab.train"])
        _CONTEXT = ctx
    return _CONTEXT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def agent_store() -> Iterator[dict[str, str]]:
    """A rendezvous store hosted by this process for one job, as torchrun's agent hosts it:
    yields the variables that point the ranks at it (`TORCHELASTIC_USE_AGENT_STORE`, so that
    no rank hosts one). Listening before any rank starts, it spares the ranks the wait of a
    rank hosting it: a rank that connects before rank 0 has bound the port is refused and
    retries after a back-off (0.75 s of a 1.7 s warm 2-rank job on CI's 2 cores)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    try:
        yield dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                   TORCHELASTIC_USE_AGENT_STORE="True")  # fmt: skip
    finally:
        del store


def _rank_main(args: list[str], env: dict[str, str], out: str, err: str) -> None:
    """One rank: its environment, stdout / stderr to files, then titanlab.train's main."""
    # The server's objects (every imported module) are shared with it copy-on-write: kept out
    # of the garbage collector's scans, which would otherwise write to (and so copy) their pages.
    gc.freeze()
    for path, fd in ((out, 1), (err, 2)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    _apply_thread_count(env)
    os.chdir(REPO)
    sys.argv = ["titanlab.train", *args]
    from titanlab.distributed.init import exit_process
    from titanlab.train import main

    exit_process(main(args))


def _apply_thread_count(env: dict[str, str]) -> None:
    """Give this rank the intra-op threads its `OMP_NUM_THREADS` asks for. OpenMP read the
    server's environment when the server imported torch, so the variable set after the fork
    changes nothing by itself: a run launched from a shell without it gave each of 4 ranks
    on 2 cores 2 threads, and a 4-stage pipeline, whose idle ranks' threads then spin on the
    shared cores, stepped in 5 s instead of 0.75 s (measured here, torch 2.13)."""
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def fork_run(
    nproc: int,
    args: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 900,
    log_rank: int | None = None,
) -> subprocess.CompletedProcess:
    """Run `titanlab.train` with `args` on `nproc` ranks forked from the preloaded server.

    Args:
        nproc: number of ranks (1 runs a single process, with no rank variables set, as
            `python -m titanlab.train` does).
        args: the trainer's command-line options.
        env: the ranks' environment (default: this process's), to which the rank variables are
            added.
        timeout: seconds before every rank is killed and `subprocess.TimeoutExpired` raised.
        log_rank: keep only this rank's stdout (run_train.sh's LOG_RANK); None: every rank's.
    Returns:
        A CompletedProcess: returncode 0, or the exit code of the first rank that failed (a
        negative signal number for a rank killed by a signal); stdout and stderr are the ranks'
        in rank order, stderr ending with a `rank R exitcode : C` line per failed rank.
    """
    ctx = _context()
    base = dict(os.environ if env is None else env)
    with contextlib.ExitStack() as job:
        if nproc > 1:
            base.update(job.enter_context(agent_store()))
        logs = job.enter_context(tempfile.TemporaryDirectory(prefix="titanlab-ranks-"))
        procs: list = []
        try:
            for rank in range(nproc):
                rank_env = dict(base)
                if nproc > 1:
                    rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                    LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0")  # fmt: skip
                files = (os.path.join(logs, f"{rank}.out"), os.path.join(logs, f"{rank}.err"))
                proc = ctx.Process(target=_rank_main, args=(args, rank_env, *files))
                proc.start()
                procs.append(proc)
            returncode = _wait(procs, timeout, [" ".join(args)])
        except BaseException as e:  # a failed start, a timeout, Ctrl-C: no rank outlives us
            _stop(procs, signal.SIGKILL)
            for p in procs:
                p.join()
            if isinstance(e, subprocess.TimeoutExpired):  # the ranks' logs go with it
                e.output, e.stderr = _read_logs(logs, nproc)
            raise
        outs, errs = _read_logs(logs, nproc, log_rank)
    failed = [f"rank {r} exitcode : {p.exitcode}" for r, p in enumerate(procs) if p.exitcode]
    stderr = errs + "".join(line + "\n" for line in failed)
    return subprocess.CompletedProcess(args, returncode, outs, stderr)


def _read_logs(logs: str, nproc: int, log_rank: int | None = None) -> tuple[str, str]:
    """The ranks' stdout and stderr, each concatenated in rank order (stdout: only rank
    `log_rank`'s when given, as torchrun's `--local-ranks-filter` shows)."""
    outs, errs = [], []
    for rank in range(nproc):
        for name, into in (("out", outs), ("err", errs)):
            if name == "out" and log_rank is not None and rank != log_rank:
                continue
            path = os.path.join(logs, f"{rank}.{name}")
            if os.path.exists(path):  # absent when the fork failed before the rank began
                with open(path, encoding="utf-8", errors="replace") as f:
                    into.append(f.read())
    return "".join(outs), "".join(errs)


def _wait(procs: list, timeout: float, cmd: list[str]) -> int:
    """Wait for every rank; the first failure stops the rest. Returns the launch's exit code."""
    deadline = time.monotonic() + timeout
    first_failure = 0
    while any(p.exitcode is None for p in procs):
        if time.monotonic() > deadline:
            _stop(procs, signal.SIGKILL)
            raise subprocess.TimeoutExpired(cmd, timeout)
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed and not first_failure:
            first_failure = failed[0]
            _stop(procs, signal.SIGTERM)
            stop_at = time.monotonic() + GRACE_S
            while any(p.exitcode is None for p in procs) and time.monotonic() < stop_at:
                time.sleep(0.05)
            _stop(procs, signal.SIGKILL)
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], 0.5)
    for p in procs:
        p.join()
    if first_failure:
        return first_failure
    return next((p.exitcode for p in procs if p.exitcode), 0)


def _stop(procs: list, sig: int) -> None:
    for p in procs:
        if p.exitcode is None and p.pid is not None:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
