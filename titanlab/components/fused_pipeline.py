"""The chunked fused loss under pipeline parallel: the last stage's forward ends in the loss.

`torch.distributed.pipelining` calls `loss_fn(stage_output, target)` on the last stage, after
its forward, so the head would have to return logits. With `loss.fused_linear_cross_entropy`
the head (`FusedLossHead`) computes the loss itself, inside the stage's forward, where FSDP has
gathered its weight. So the trainer gives the schedule each batch's labels as a keyword
(`labels=`, split into microbatches along dim 0 as the inputs are, and under context parallel
sharded along the sequence as they are); `take_labels` pops the keyword in every stage before
its forward and hands it to the stage's head, if it has one, for that forward only. The
stage's output is then its microbatch's token-loss sum ((1,) fp32), which `returned_loss`
passes to the schedule as the loss.

Trained multi-token prediction depths (DeepSeek-V3, on the last stage) need each microbatch's
labels in the same way: `take_labels` also hands them to the stage (`mtp_labels`) while it is
inside `titanlab.models.common.mtp.mtp_targets`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titanlab.components.fused_head import FusedLossHead

LABELS = "labels"


def take_labels(stage: nn.Module) -> None:
    """Hooks on `stage` (a pipeline stage's module): before its forward, the `labels` keyword
    ((microbatch, seq) int64, -100 ignored) is removed and set on `stage.output` when that is a
    `FusedLossHead`, and as `stage.mtp_labels` when the stage computes trained MTP depths'
    loss (`mtp_active`); after it, both are cleared (a later forward returns logits)."""
    head = getattr(stage, "output", None)
    head = head if isinstance(head, FusedLossHead) else None
    has_mtp = getattr(stage, "mtp", None) is not None

    def before(module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        labels = kwargs.pop(LABELS, None)
        if head is not None:
            head.labels = labels
        if has_mtp and getattr(module, "mtp_active", False):
            module.mtp_labels = labels
        return args, kwargs

    def after(module: Any, args: tuple, output: Any) -> Any:
        if has_mtp and getattr(module, "mtp_active", False):
            module.mtp_labels = None
        if head is None or head.labels is None:  # no labels given: logits
            return None
        head.labels = None
        # (1,): the schedule concatenates the last stage's outputs along dim 0 at the end of
        # the step, which a 0-dim tensor does not allow. A copy, not a view: the stage detaches
        # its output in place after the backward's input half, which it cannot do to a view;
        # a view kept the graph alive until the step's end, and with it (zero-bubble
        # schedules) every tensor saved by nodes the weight half does not run (attention's,
        # the activation function's), ~1.8 MiB per microbatch on the debug model.
        return output.reshape(1).clone()

    stage.register_forward_pre_hook(before, with_kwargs=True)
    stage.register_forward_hook(after)


def returned_loss(loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The pipeline's `loss_fn` with the fused head: the last stage's output already is the
    microbatch's token-loss sum ((1,) fp32, see `take_labels`); returned 0-dim. `labels` were
    used by the head."""
    return loss_sum.reshape(())
