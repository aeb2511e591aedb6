"""Process-group set-up: pick the device and backend, apply the init and training timeouts.

The same code runs under torchrun on GPUs (NCCL) and on CPUs (gloo): the device is CUDA when
one is visible, else CPU. A plain `python -m titanlab.train` (no torchrun) runs as a world of one.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d


def device_type() -> str:
    """'cuda' when a CUDA device is visible, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


_IDENTITY_SET_HERE: list[str] = []
"""The rank identity `init_distributed` wrote into os.environ for a world of one, removed again
by `destroy_distributed`: left behind, a later launch from the same process (a test, a
notebook) would take RANK / MASTER_PORT as its own and join a store that is gone."""


def init_distributed(init_timeout_s: int) -> tuple[torch.device, int, int]:
    """Create the default process group (cuda:nccl + cpu:gloo, or cpu:gloo).

    Args:
        init_timeout_s: seconds any collective may wait until `set_train_timeout` is called.
    Returns:
        (device, rank, world_size). The device is `cuda:<LOCAL_RANK>` or `cpu`.
    """
    if "RANK" not in os.environ:  # a world of one, launched without torchrun
        identity = dict(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT="0",  # the store binds a port the OS picks (`_attempt_store`)
        )
        os.environ.update(identity)
        _IDENTITY_SET_HERE[:] = list(identity)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type() == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=init_timeout_s)
    dist.init_process_group(
        backend=backend,
        store=_attempt_store(rank, world_size, timeout),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return device, dist.get_rank(), dist.get_world_size()


def init_fake_world(world_size: int, device: str = "meta") -> tuple[torch.device, int, int]:
    """The default process group of a world simulated in this one process: PyTorch's "fake"
    backend (a collective returns at once and moves no data) as rank 0 of `world_size`. A dry
    run (`device` "meta") builds its meshes, FSDP/TP/EP/PP and DCP plans over it at their real
    shapes and allocates nothing; under local tensors (`device` "cpu") every rank's shard is
    real and the collectives are computed by `torch.distributed._local_tensor`.

    Returns:
        (torch.device(device), 0, world_size).
    """
    # importing torch's fake process group registers the "fake" backend (torchtitan does too)
    import torch.testing._internal.distributed.fake_pg

    dist.init_process_group(backend="fake", store=dist.HashStore(), rank=0, world_size=world_size)
    return torch.device(device), 0, world_size


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store, namespaced by torchrun's restart count.

    torchrun's c10d rendezvous keeps one store across restarts of the group; without a fresh
    namespace a restarted rank can read the previous attempt's (dead) gloo addresses and fail
    to connect ("Connection refused").
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    port = int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        port,
        world_size,
        is_master=not agent_hosts_store and rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    if port == 0:  # a world of one without torchrun: bound where the OS chose, no race for it
        os.environ["MASTER_PORT"] = str(store.port)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"titanlab/attempt_{attempt}", store)


def set_train_timeout(train_timeout_s: int) -> None:
    """Shorten the timeout of every process group once the first step has run.

    A rank that stops taking part in a collective then fails the job after `train_timeout_s`
    instead of after the (longer) init timeout.
    """
    timeout = timedelta(seconds=train_timeout_s)
    dist.barrier()
    for group in distributed_c10d._world.pg_map:  # every group, including mesh sub-groups
        distributed_c10d._set_pg_timeout(timeout, group)


def destroy_distributed(barrier: bool = True) -> None:
    """End the default process group (a no-op when there is none).

    With `barrier` (the normal end), every rank first waits for the others, so no rank tears
    down its gloo connections while a peer still uses them: a rank that exits while a peer's
    send or receive is in flight can abort with "terminate called without an active exception".
    Pass `barrier=False` after an error, when the peers may never arrive. The rank identity
    `init_distributed` set for a world of one leaves os.environ (also when the group never
    came up).
    """
    try:
        if dist.is_initialized():
            if barrier:
                dist.barrier()
            dist.destroy_process_group()
    finally:
        for key in _IDENTITY_SET_HERE:
            os.environ.pop(key, None)
        _IDENTITY_SET_HERE.clear()


_OWN_GROUP_THREADS = False


def hold_group_threads() -> None:
    """Record that this process runs a process group of its own beside torch.distributed's
    default one (fault tolerance's managed gloo or NCCL group, also in a replica group of one
    rank): `exit_process` then skips interpreter finalization, as under torchrun."""
    global _OWN_GROUP_THREADS
    _OWN_GROUP_THREADS = True


def exit_process(status: int) -> None:
    """Exit with `status` once `main` has returned (and `destroy_distributed` has run).

    Under torchrun (WORLD_SIZE > 1), or with a process group of its own (`hold_group_threads`),
    the output is flushed and interpreter finalization is skipped: a gloo worker thread was
    seen, under CPU load, to abort a rank there with "terminate called without an active
    exception" (SIGABRT) after a correct run, turning its exit status into a failure (also a
    fault-tolerant replica group of one rank, whose WORLD_SIZE is 1, on 2026-12-03). A single
    process exits normally (exit handlers, module teardown)
    with every object alive at this point frozen out of the garbage collector first
    (`gc.freeze`): the collections of finalization otherwise walk every object torch's imports
    made, 0.7 s of each run's end on CPU, for memory the OS takes back anyway.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or _OWN_GROUP_THREADS:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    gc.freeze()
    sys.exit(status)
