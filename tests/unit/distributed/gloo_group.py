"""Start the gloo process group of one spawned test rank: one intra-op thread, a file
rendezvous, a 60 s timeout. The worker ends it in a `finally` with
`destroy_distributed(barrier=ok)` (`titanlab.distributed.init`), which waits for every rank.
`spawn` runs the ranks on the warm workers of `tools.lib.rank_pool` (kept across tests: the
imports and first-call costs are paid once per pytest worker), or with TITANLAB_WARM_RANKS=0
as `torch.multiprocessing.spawn` children that end without interpreter finalization."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.lib.rank_pool import MAX_WORKERS, default_pool


def init_gloo(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )


def _run_then_exit(rank: int, fn: Callable[..., None], *args: Any) -> None:
    """`fn(rank, *args)`, then the process ends without interpreter finalization (as the
    trainer's `exit_process` does): a gloo worker thread was seen, under CPU load, to abort a
    correct rank there with "terminate called without an active exception". An exception in
    `fn` propagates as usual (the spawn wrapper reports it and exits 1)."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` on `nprocs` warm ranks (`RankPool.spawn`: raises SpawnFailed with the
    failing rank's traceback); with TITANLAB_WARM_RANKS=0, or more ranks than the pool holds
    (`MAX_WORKERS`: make test-full's 16-rank TP grids), `torch.multiprocessing.spawn(fn, args,
    nprocs)` whose ranks skip finalization after a normal return (`_run_then_exit`)."""
    if os.environ.get("TITANLAB_WARM_RANKS", "1") == "0" or nprocs > MAX_WORKERS:
        mp.spawn(_run_then_exit, args=(fn, *args), nprocs=nprocs, join=True)
    else:
        default_pool().spawn(fn, args, nprocs)
