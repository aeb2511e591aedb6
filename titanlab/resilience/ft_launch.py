"""Launching a fault-tolerant job on one machine: torchft's lighthouse, then one launcher per
replica group (`run_train.sh` and `titanlab train` with `fault_tolerance.enable = true` and no
lighthouse given).

Each group is `titanlab.launcher` with its own torchrun agent, rendezvous and NGPU ranks (on a
GPU machine its own NGPU GPUs: group g sees GPUs g·NGPU … (g+1)·NGPU − 1); its ranks' output
is prefixed `[g<id>rank<N>]:`. `MAX_RESTARTS` restarts a failed group by itself: relaunched,
it loads its own newest checkpoint (its data position) and recovers the weights, optimizer
state and step from a live peer while the other groups keep training. The lighthouse runs
until every group has ended; the exit code is the first nonzero one of the groups, else 0.
Across machines (`multinode_trainer.slurm`) a group per node set is started the same way, with
`TORCHFT_LIGHTHOUSE` naming a lighthouse started once for the job.

Source: torchft's README (the lighthouse, `TORCHFT_LIGHTHOUSE`, one launch per replica group).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

from titanlab.config.errors import ConfigError
from titanlab.config.fault_tolerance import LIGHTHOUSE_ENV

LIGHTHOUSE_BINARY = "torchft_lighthouse"
JOIN_TIMEOUT_MS = 10000
"""How long the lighthouse waits for a live group (one whose heartbeats arrive) to ask for a
quorum that already has min_replicas: longer than the step-to-step lag of groups that run
without a fault (a slower validation or checkpoint write, shared cores), so that none is left
out of a step it would have made; a group that died stops its heartbeats and is not waited for
past HEARTBEAT_TIMEOUT_MS. torchft's default is 60 s."""
HEARTBEAT_TIMEOUT_MS = 3000
"""A group whose heartbeats stop this long is left out of the next quorum."""


def lighthouse_binary() -> str:
    """torchft's lighthouse: beside this interpreter (a virtual environment's bin/), else on
    PATH. Raises ConfigError when torchft is not installed."""
    beside = os.path.join(os.path.dirname(sys.executable), LIGHTHOUSE_BINARY)
    found = beside if os.access(beside, os.X_OK) else shutil.which(LIGHTHOUSE_BINARY)
    if found is None:
        raise ConfigError(
            "fault_tolerance.enable=true needs torchft's lighthouse: pip install 'titanlab[ft]'"
        )
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::", 0))
        return s.getsockname()[1]


def start_lighthouse(min_replicas: int, log: str = os.devnull) -> tuple[subprocess.Popen, str]:
    """Start the lighthouse, its output to the file `log`; returns (its process, its address
    for `TORCHFT_LIGHTHOUSE`)."""
    port = free_port()
    command = [
        lighthouse_binary(),
        "--min_replicas", str(min_replicas),
        "--bind", f"[::]:{port}",
        "--join_timeout_ms", str(JOIN_TIMEOUT_MS),
        "--quorum_tick_ms", "50",
        "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS),
    ]  # fmt: skip
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    address = f"http://{socket.gethostname()}:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # listening?
        try:
            with socket.create_connection(("localhost", port), timeout=1):
                return process, address
        except OSError:
            if process.poll() is not None:
                break
            time.sleep(0.1)
    process.kill()
    raise ConfigError(f"fault_tolerance: torchft's lighthouse did not start on port {port}")


def group_command(torchrun: list[str], replica_id: int) -> list[str]:
    """`titanlab.launcher`'s arguments `torchrun` (as `titanlab train` builds them) for group
    `replica_id`: its own rendezvous, its ranks' output prefixed `[g<id>rank<N>]:`."""
    args = []
    for arg in torchrun:
        if arg.startswith("--rdzv_endpoint="):
            arg = "--rdzv_endpoint=localhost:0"  # each group its own rendezvous
        elif arg == "--role=rank":
            arg = f"--role=g{replica_id}rank"
        args.append(arg)
    return [sys.executable, "-m", "titanlab.launcher", *args,
            "--fault_tolerance.replica_id", str(replica_id)]  # fmt: skip


def visible_devices(replica_id: int, nproc: int, gpus: int) -> dict[str, str]:
    """The environment that gives group `replica_id` its own `nproc` of the machine's `gpus`
    GPUs (nothing without GPUs). Raises ConfigError when there are too few."""
    if gpus == 0:
        return {}
    first = replica_id * nproc
    if first + nproc > gpus:
        raise ConfigError(
            f"fault_tolerance: group {replica_id} needs GPUs {first}-{first + nproc - 1} "
            f"(NGPU={nproc} per group) but this machine has {gpus}; lower NGPU or "
            "fault_tolerance.replica_count"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(first, first + nproc))}


def run_groups(
    torchrun: list[str], nproc: int, replica_count: int, min_replicas: int, gpus: int, log: str
) -> int:
    """Start the lighthouse (its output to the file `log`) and `replica_count` groups of
    `nproc` ranks (`torchrun`: the launcher's arguments, the config already checked); wait
    for them all. Returns the first nonzero exit code of the groups, else 0."""
    envs = [visible_devices(g, nproc, gpus) for g in range(replica_count)]  # checked first
    lighthouse, address = start_lighthouse(min_replicas, log)
    print(f"fault tolerance: lighthouse at {address} (log: {log}), {replica_count} replica "
          f"groups of {nproc} ranks", file=sys.stderr, flush=True)  # fmt: skip
    groups = []
    try:
        for g in range(replica_count):
            env = dict(os.environ, **envs[g], **{LIGHTHOUSE_ENV: address})
            groups.append(subprocess.Popen(group_command(torchrun, g), env=env))
        codes = [group.wait() for group in groups]
    finally:
        for group in groups:
            if group.poll() is None:
                group.terminate()
        lighthouse.terminate()
        lighthouse.wait()
    return next((code for code in codes if code != 0), 0)
