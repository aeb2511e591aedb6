"""The worker side of `tools.lib.rank_pool`: a warm worker's loop, one job's run, and the
process state taken before the first job and put back after each.

A job may change, in its process: the environment, the working directory, `sys.argv` and
`sys.path`, the random states (torch, Python, NumPy), torch's global flags, the configs of
Dynamo, Inductor and functorch, Dynamo's compiled code, logging's root handlers, the warnings
filters and the signal handlers; each is put back. What cannot be put back makes the worker
retire (it exits, and the pool forks a fresh one): a thread or child process that outlived the
job, a process group still up, resident memory past `MAX_RSS_BYTES`, context parallel's CPU
attention handler (DTensor strategies registered for good). DTensor's sharding caches are kept
warm from job to job, their meshes made valid for each job by `tools.lib.pool_mesh`.
"""

from __future__ import annotations

import functools
import gc
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

from tools.lib import fork_launch
from tools.lib.pool_mesh import MeshAliases

MAX_RSS_BYTES = 3 * 2**30
"""A worker whose resident memory passes this after a job is retired."""
PROCESS_THREADS = ("tqdm_monitor",)
"""Threads a library starts once per process and keeps (tqdm's monitor): not a job's leftovers."""
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


@dataclass
class Job:
    """One rank's part of a pool job."""

    target: str
    """"module:function"."""
    args: list[Any]
    env: dict[str, str]
    out: str
    """File that receives the rank's stdout."""
    err: str
    paths: list[str] = field(default_factory=list)
    """Folders put in front of `sys.path` for the job."""
    rank: int = 0
    spawned: bool = False
    """`target(rank, *args)` (torch.multiprocessing.spawn's convention) instead of
    `target(args)`."""


def worker_main(conn: multiprocessing.connection.Connection) -> None:
    """Run jobs from `conn` until it closes; after each, report (exit code, why the worker
    cannot be reused or None)."""
    gc.freeze()  # the server's objects stay shared copy-on-write (see fork_launch)
    idle = os.open(os.devnull, os.O_WRONLY)
    os.dup2(idle, 1)
    os.dup2(idle, 2)
    for stream in (sys.stdout, sys.stderr):  # a hung rank's last line is in its file
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    state = _State.take()
    MESHES.install()
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        code = _run_job(job)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(idle, 1)
        os.dup2(idle, 2)
        dirty = state.restore()
        conn.send((code, dirty))
        if dirty:
            os._exit(0)


def _run_job(job: Job) -> int:
    for path, fd in ((job.out, 1), (job.err, 2)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(job.env)
    fork_launch._apply_thread_count(job.env)
    os.chdir(fork_launch.REPO)
    sys.path[:0] = job.paths
    module, _, name = job.target.partition(":")
    sys.argv = [module, *job.args]
    try:
        fn = getattr(importlib.import_module(module), name)
        if job.spawned:
            fn(job.rank, *job.args)
            return 0
        return int(fn(list(job.args)) or 0)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()  # what an uncaught exception prints, and its exit status
        return 1


@dataclass
class _State:
    """What a job may change in its process, taken before the first job and put back after
    each (`restore` says whether the worker can be reused)."""

    environ: dict[str, str]
    cwd: str
    argv: list[str]
    path: list[str]
    rng: Any
    py_rng: Any
    np_rng: Any
    flags: dict[str, Any]
    configs: dict[str, bytes]
    handlers: list[logging.Handler]
    level: int
    filters: list
    signals: dict[int, Any]
    threads: int

    @classmethod
    def take(cls) -> _State:
        import numpy as np
        import torch

        return cls(dict(os.environ), os.getcwd(), list(sys.argv), list(sys.path),
                   torch.random.get_rng_state(), random.getstate(), np.random.get_state(),
                   _torch_flags(), _configs(), list(logging.getLogger().handlers),
                   logging.getLogger().level, list(warnings.filters),
                   {s: signal.getsignal(s) for s in _SIGNALS},
                   threading.active_count())  # fmt: skip

    def restore(self) -> str | None:
        import numpy as np
        import torch
        import torch.distributed as dist

        dirty = []
        if dist.is_initialized():
            dirty.append("a process group is still up")
        torch._dynamo.reset()
        MESHES.end_job()
        _clear_caches()
        for module, saved in self.configs.items():
            importlib.import_module(module).load_config(saved)
        torch.use_deterministic_algorithms(self.flags["deterministic"],
                                           warn_only=self.flags["warn_only"])  # fmt: skip
        torch.set_default_dtype(self.flags["dtype"])
        torch.set_grad_enabled(self.flags["grad"])
        torch.set_float32_matmul_precision(self.flags["matmul"])
        torch.autograd.set_detect_anomaly(self.flags["anomaly"])
        torch.random.set_rng_state(self.rng)
        random.setstate(self.py_rng)
        np.random.set_state(self.np_rng)
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.argv[:] = self.argv
        sys.path[:] = self.path
        root = logging.getLogger()
        for handler in list(root.handlers):
            if handler not in self.handlers:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(self.level)
        warnings.filters[:] = self.filters
        for sig, handler in self.signals.items():
            signal.signal(sig, handler)
        gc.collect()
        gc.freeze()  # what outlived the job (modules it imported, caches) is not scanned again
        cp_cpu = sys.modules.get("titanlab.distributed.context_parallel.cpu")
        if cp_cpu is not None and getattr(cp_cpu, "_installed", False):
            dirty.append("context parallel's CPU handler is installed for good")
        left = [t.name for t in threading.enumerate() if t.name not in PROCESS_THREADS]
        if len(left) > self.threads:
            dirty.append(f"threads left: {left}")
        if multiprocessing.active_children():
            dirty.append("child processes left")
        if _rss_bytes() > MAX_RSS_BYTES:
            dirty.append(f"resident memory {_rss_bytes() / 2**30:.1f} GiB")
        return "; ".join(dirty) or None


def _torch_flags() -> dict[str, Any]:
    import torch

    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "matmul": torch.get_float32_matmul_precision(),
        "anomaly": torch.is_anomaly_enabled(),
    }


def _configs() -> dict[str, bytes]:
    """Dynamo's, Inductor's and functorch's configs (`save_config`)."""
    names = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
    return {name: importlib.import_module(name).save_config() for name in names}


CACHED_PACKAGES = ("torch.distributed", "titanlab")
"""Packages whose module- and class-level `functools` caches are cleared after each job."""
MESHES = MeshAliases()
"""The worker's meshes, aliased across jobs so that DTensor's sharding caches stay valid."""


def _kept_caches() -> set[int]:
    """The ids of the `functools` caches kept across jobs: DTensor's tensor-meta propagation
    (its values hold no mesh; its keys' meshes are aliased by `MESHES`)."""
    prop = sys.modules.get("torch.distributed.tensor._sharding_prop")
    if prop is None:
        return set()
    return {id(vars(prop.ShardingPropagator)["_propagate_tensor_meta_cached"])}


def _clear_caches() -> None:
    """Empty the `functools` caches of `CACHED_PACKAGES` that a job filled and that can hold
    its objects (all but `_kept_caches`). DTensor's sharding caches (the C++ dispatch fast path's
    and Python's `propagate_op_sharding`) are kept: their specs' meshes are aliased to the next
    job's equal meshes (`tools.lib.pool_mesh`); emptied instead, they cost every job the
    uncached propagation of every op."""
    cached = functools._lru_cache_wrapper
    kept = _kept_caches()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(CACHED_PACKAGES):
            continue
        for value in list(vars(module).values()):
            is_class = issubclass(type(value), type)  # type(): no module's __class__ hook
            for item in [value, *(vars(value).values() if is_class else ())]:
                if type(item) in (staticmethod, classmethod):
                    item = item.__func__
                if type(item) is cached and id(item) not in kept:
                    item.cache_clear()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
