"""Preemption: on SIGTERM or SIGUSR1, finish the current step, save a checkpoint and exit with
`REQUEUE_EXIT_CODE` so the launcher (run_train.sh, the SLURM script) requeues the job.

Signals reach the ranks at slightly different times, so after every step the ranks agree with
one tiny all-reduce (max of "a signal arrived here") and all stop at the same step. The flag is a
host tensor reduced over a gloo group, whatever the training backend, so the check never makes
the host wait for the accelerator's queue.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

# EX_TEMPFAIL of sysexits.h (a temporary failure, the caller is invited to retry) and the marker
# file's variable, defined beside the launcher that reads them.
from titanlab.resilience.launcher import MARKER_ENV, REQUEUE_EXIT_CODE

__all__ = ["MARKER_ENV", "REQUEUE_EXIT_CODE", "Preempted", "PreemptionHandler"]


class Preempted(Exception):
    """Raised to leave the training loop after the preemption checkpoint was written."""


class PreemptionHandler:
    """Records SIGTERM/SIGUSR1 and tells every rank, at the same step, whether to stop."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        # A collective: every rank constructs the handler at the same point.
        self._group = None
        # (a simulated world's "fake" group has no peers to wait for: comm.mode local_tensor)
        if (
            dist.is_initialized()
            and dist.get_world_size() > 1
            and dist.get_backend()
            not in (
                "gloo",
                "fake",
            )
        ):
            self._group = dist.new_group(backend="gloo")

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    def should_stop(self) -> bool:
        """True on every rank once any rank has received a signal (a collective: call it on
        all ranks at the same point of every step)."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0])  # on the host
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def signal_name(self) -> str:
        return (
            signal.Signals(self.received).name if self.received is not None else "a peer's signal"
        )

    @staticmethod
    def mark_for_requeue(step: int) -> None:
        """Tell the launcher (through the file named by $TITANLAB_PREEMPT_MARKER) to requeue."""
        path = os.environ.get(MARKER_ENV)
        if path:
            with open(path, "w") as f:
                f.write(f"{step}\n")

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
