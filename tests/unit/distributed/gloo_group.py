"""Start the gloo process group of one spawned test rank (`torch.multiprocessing.spawn`): one
intra-op thread, a file rendezvous, a 60 s timeout. The worker ends it in a `finally` with
`destroy_distributed(barrier=ok)` (`titanlab.distributed.init`), which waits for every rank."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def init_gloo(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
