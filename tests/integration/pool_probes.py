"""Targets for tests/integration/test_rank_pool.py: small jobs a warm worker runs in place of
`titanlab.train.main` (each takes the argument list and returns an exit code)."""

from __future__ import annotations

import os
import random
import time

import torch
import torch.distributed as dist

from titanlab.distributed.init import destroy_distributed


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def crash_rank_1(args: list[str]) -> int:
    """Rank 1 prints a line and dies of SIGSEGV; rank 0 waits in a collective for it."""
    dist.init_process_group("gloo")
    print(f"rank {_rank()} about to fail", flush=True)
    if _rank() == 1:
        os.kill(os.getpid(), 11)
    dist.barrier()
    return 0


def hang_rank_1(args: list[str]) -> int:
    """Rank 1 prints a line and sleeps for good; rank 0 returns."""
    print(f"rank {_rank()} started", flush=True)
    if _rank() == 1:
        print("rank 1 is stuck here", flush=True)
        time.sleep(3600)
    return 0


def dirty_the_process(args: list[str]) -> int:
    """Changes what a job may change in its process: flags, seeds, environment, directory."""
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    random.seed(1234)
    os.environ["TITANLAB_POOL_PROBE"] = "left behind"
    os.chdir("/")
    return 0


def report_state(args: list[str]) -> int:
    """Prints the state `dirty_the_process` changes, and one all-reduce's result."""
    dist.init_process_group("gloo")
    total = torch.ones(1) * (_rank() + 1)
    dist.all_reduce(total)
    destroy_distributed()
    print(
        f"deterministic={torch.are_deterministic_algorithms_enabled()} "
        f"dtype={torch.get_default_dtype()} rand={torch.rand(1).item():.6f} "
        f"py={random.random():.6f} env={os.environ.get('TITANLAB_POOL_PROBE')} "
        f"cwd={os.getcwd()} sum={total.item():g}",
        flush=True,
    )
    return 0


def tensor_parallel_matmul(args: list[str]) -> int:
    """A column- then row-sharded matmul on a 2-rank mesh named `args[0]` (DTensor's sharding
    propagation, an all-reduce on the mesh's group); prints the result's sum, the propagation
    cache's misses and how many meshes of earlier jobs the worker aliased (`tools.lib.pool_mesh`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from tools.lib import pool_worker

    propagator = DTensor._op_dispatcher.sharding_propagator
    uncached = propagator.propagate_op_sharding_non_cached
    misses = []

    def counted(schema):
        misses.append(schema)
        return uncached(schema)

    propagator.propagate_op_sharding_non_cached = counted
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(args[0],))
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(4, 8), torch.randn(8, 6), torch.randn(6, 8)
    cols = distribute_tensor(w1, mesh, [Shard(1)])
    rows = distribute_tensor(w2, mesh, [Shard(0)])
    out = (distribute_tensor(x, mesh, [Replicate()]) @ cols).relu() @ rows
    total = out.full_tensor().sum().item()
    del propagator.propagate_op_sharding_non_cached
    destroy_distributed()
    print(f"sum={total:.6f} misses={len(misses)} "
          f"aliased={pool_worker.MESHES.aliased}", flush=True)  # fmt: skip
    return 0
