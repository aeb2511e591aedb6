"""How a training rank ends on an error: one `titanlab: error:` line and a documented exit code.

Exit codes (also in docs/troubleshooting.md): 2 a configuration or input error, 3 the loss
diverged, 4 a collective timed out (a peer rank hung or died), 5 a rank ran out of memory. 75, a preemption, is in
`titanlab.resilience.preemption`. The line goes to this rank's stderr and to the file `titanlab.resilience.launcher`
reads, so the launcher can print it last, after torchrun's own report.
"""

from __future__ import annotations

import sys

import torch

from titanlab.resilience.launcher import write_error_file

CONFIG_ERROR_EXIT_CODE = 2
DIVERGED_EXIT_CODE = 3
HANG_EXIT_CODE = 4
OOM_EXIT_CODE = 5


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


def is_collective_timeout(e: BaseException) -> bool:
    """Whether `e` is a process-group timeout (gloo: "Timed out waiting"; NCCL watchdog: "timeout")."""
    text = str(e).lower()
    return isinstance(e, (RuntimeError, torch.distributed.DistError)) and (
        "timed out" in text or "timeout" in text
    )


class QuorumTimeout(RuntimeError):
    """Fault tolerance: no quorum of enough replica groups formed in time; the message is one
    line."""


class OutOfMemory(RuntimeError):
    """A rank ran out of device or host memory; the message is the whole error line."""


def is_out_of_memory(e: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), or the CPU allocator's failure (a plain RuntimeError
    "DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    )


def oom_line(rank: int, step: int, snapshot: str | None) -> str:
    """The error line for an out-of-memory error on `rank` during `step`; `snapshot` is the
    memory snapshot written for it (profiling.enable_memory_snapshot), if any."""
    where = (
        f"memory snapshot: {snapshot}"
        if snapshot
        else "set profiling.enable_memory_snapshot=true to record where the memory went"
    )
    return (
        f"titanlab: error: rank {rank} ran out of memory in step {step}; {where}; lower "
        "training.local_batch_size or training.seq_len, turn on activation_checkpoint.mode, or "
        "shard more (parallelism degrees)"
    )


def timeout_line(e: BaseException, rank: int, step: int, timeout_s: int, last: str | None) -> str:
    """The error line for a collective that timed out on `rank` at `step` (first line of `e` kept).

    `timeout_s` is comm.train_timeout_seconds; `last` the newest complete checkpoint, if any.
    """
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    return (
        f"titanlab: error: rank {rank}: a collective timed out at step {step} "
        f"(comm.train_timeout_seconds={timeout_s}); a peer rank stopped responding. "
        f"Last complete checkpoint: {last or 'none'}. ({first})"
    )


def fail(line: str, exit_code: int) -> int:
    """Print this rank's one error line, record it for `titanlab.resilience.launcher`, return `exit_code`."""
    print(line, file=sys.stderr, flush=True)
    write_error_file(line, exit_code)
    return exit_code
