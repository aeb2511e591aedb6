"""The steps since the last log line: host timings, and device values fetched in one transfer.

Calling `.item()` on the loss every step makes the host wait for the accelerator's queue to
drain, every step. The loop instead hands this window the step's loss, gradient norm and extras
as 0-d device tensors; `fetch` copies every pending value to the host in one
`torch.stack(...).tolist()` only when the host needs them (a logging, validation or checkpoint
step, the last step, a preemption), which is when non-finite losses are found.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass
class StepRecord:
    """One optimizer step. `values` holds `loss`, `grad_norm` and the extras (e.g. the MoE
    layers' `moe/...`) as floats once fetched; `pending` the same as 0-d device tensors until then.
    Times are host wall seconds: `step_s` from asking for the batch to the end of the optimizer
    step (on CUDA the end of the host's work, which the synchronizing steps make exact over the
    window), `data_s` the part spent waiting for the batch."""

    step: int
    step_s: float
    data_s: float
    lr: float
    loss_scale: float | None
    pending: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    values: dict[str, float] = dataclasses.field(default_factory=dict)


class StepWindow:
    """The `StepRecord`s since the last log line."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def add(self, record: StepRecord) -> None:
        self.records.append(record)

    def fetch(self) -> list[StepRecord]:
        """Copy every pending device value to the host (one transfer); returns the records that
        were pending, in step order."""
        todo = [r for r in self.records if r.pending]
        if not todo:
            return []
        flat = [t.detach().reshape(()).float() for r in todo for t in r.pending.values()]
        host = torch.stack(flat).tolist()
        i = 0
        for r in todo:
            for key in r.pending:
                r.values[key] = host[i]
                i += 1
            r.pending = {}
        return todo

    def first_non_finite(self) -> StepRecord | None:
        """The earliest fetched step whose loss is NaN or infinite, if any."""
        return next((r for r in self.records if not math.isfinite(r.values.get("loss", 0.0))), None)

    def clear(self) -> None:
        self.records = []

    def __len__(self) -> int:
        return len(self.records)


def spread(values: list[float], scale: float = 1.0) -> tuple[float, float, float]:
    """(mean, min, max) of `values` × `scale`; (nan, nan, nan) for an empty list."""
    if not values:
        return (math.nan, math.nan, math.nan)
    return (scale * sum(values) / len(values), scale * min(values), scale * max(values))
