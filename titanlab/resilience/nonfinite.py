"""Non-finite steps (`training.skip_nonfinite_steps`): a step whose loss or global gradient norm
is NaN or infinite is not applied, and too many of them in a row stop the run.

A single bad batch (a rare overflow in one microbatch) should not end a long run, and an update
from NaN gradients would write NaN into every weight and every optimizer moment. A run that has
diverged, on the other hand, makes every step non-finite: skipping them would only burn
accelerator hours. So with `training.skip_nonfinite_steps` = N >= 0 the trainer
(`titanlab.trainer.step`) asks `NonFiniteSteps.skip` before each optimizer update: a non-finite
step is skipped with one warning naming it; the (N + 1)-th in a row raises `TrainingDiverged`
(exit code 3, one line) before its update; a finite step resets the count.

The decision must be the same on every rank, or some would step and others not (and the next
collective would hang). Both values it reads already are: the loss is summed over every
data-parallel, context-parallel and pipeline rank, and `titanlab.distributed.utils.
clip_grad_norm_` reduces the norm over every shard of every parameter (FSDP and TP over their
meshes, EP's experts over theirs, PP's stages summed over the pipeline mesh), and a NaN or an
infinity in any rank's share reaches every rank's total.

The cost: the host reads those two numbers every step (one transfer), so it waits for the
step's backward before it starts the optimizer's update instead of running ahead of the
device; the default (-1) does not check and keeps steps free of host syncs (the loop then finds
a non-finite loss at the next logging step, after its update: `titanlab.trainer.loop`).
"""

from __future__ import annotations

import logging
import math

import torch

from titanlab.resilience.failures import TrainingDiverged

logger = logging.getLogger("titanlab")


class NonFiniteSteps:
    """The count of non-finite steps in a row and the skip-or-stop decision of each step.

    Args:
        tolerated: `training.skip_nonfinite_steps`: the non-finite steps in a row that are
            skipped; the next one stops the run. -1: no check (`enabled` is False).
        scaled: float16's dynamic loss scaler is on. It already skips the update of a step whose
            gradients overflowed and lowers the scale (an overflow is a normal event under
            float16, not a sign of divergence), so only a non-finite loss counts then.
    """

    def __init__(self, tolerated: int, scaled: bool = False) -> None:
        assert tolerated >= -1, tolerated  # Training.validate refuses the rest
        self.tolerated = tolerated
        self.scaled = scaled
        self.in_a_row = 0
        self.skipped: set[int] = set()
        """Every step skipped so far (the loop does not report their losses as divergence)."""

    @property
    def enabled(self) -> bool:
        return self.tolerated >= 0

    def read(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float]:
        """(loss, grad_norm) of a step as Python floats, in one device-to-host transfer (on an
        accelerator, the host waits for the step's work so far). Both 0-dim tensors."""
        pair = torch.stack([t.detach().reshape(()).float() for t in (loss, grad_norm)])
        loss_f, norm_f = pair.tolist()
        return loss_f, norm_f

    def non_finite(self, loss: float, grad_norm: float) -> bool:
        """Whether a step with these values counts as non-finite (under the loss scaler: its
        loss only)."""
        return not math.isfinite(loss) or (not self.scaled and not math.isfinite(grad_norm))

    def skip(self, step: int, loss: float, grad_norm: float, rank: int = 0) -> bool:
        """Whether step `step`, with this global loss and gradient norm, must not be applied.

        A finite step resets the count and returns False. A non-finite one is counted; rank 0
        logs one warning naming it, and it returns True while the count is at most
        `tolerated`. Raises TrainingDiverged (the message is one line naming the step, the
        count, the option and the values) for the (tolerated + 1)-th non-finite step in a row.
        """
        if not self.non_finite(loss, grad_norm):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        if self.in_a_row > self.tolerated:
            raise TrainingDiverged(self.stop_line(step, loss, grad_norm))
        self.skipped.add(step)
        if rank == 0:
            logger.warning(
                "step %d skipped: loss %.6g, grad norm %.6g (non-finite step %d in a row of at "
                "most %d: training.skip_nonfinite_steps); weights and optimizer state unchanged",
                step, loss, grad_norm, self.in_a_row, self.tolerated,
            )  # fmt: skip
        return True

    def stop_line(self, step: int, loss: float, grad_norm: float) -> str:
        """The error of the step that stops the run (`TrainingDiverged`, exit code 3)."""
        option = f"training.skip_nonfinite_steps={self.tolerated}"
        if self.in_a_row == 1:
            where = f"step {step}: loss or grad norm non-finite ({option})"
        else:
            first = step - self.in_a_row + 1
            where = (
                f"step {step}: loss or grad norm non-finite for {self.in_a_row} consecutive "
                f"steps ({first}-{step}; {option})"
            )
        return f"{where}: loss {loss:.6g}, grad norm {grad_norm:.6g}, stopped before its update"
