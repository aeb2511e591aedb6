"""The trainer's entry point (`titanlab.train.main`) with non-finite steps injected inside each
rank, for tests/integration/test_nonfinite_steps.py (warm ranks: target `nonfinite_runs:pool_main`).

argv: OUT, FAULTS, then the trainer's options. FAULTS names steps and what goes wrong in them,
e.g. `3:loss,5:grad,6:loss`:
- `loss`: every rank's token embedding returns NaN for that step, as a forward that overflowed
  on a bad batch would: the loss and every gradient of the step are NaN.
- `grad`: after backward, before the clip, rank 0 alone writes NaN into one element of its own
  shard of one gradient (an expert's when the model has experts), as a broken reduction would:
  the loss stays finite and only the global gradient norm tells the other ranks.
Each rank appends to `OUT/rank<R>.jsonl`, after every step it finishes, `{"step", "skipped",
"state"}`: whether the trainer skipped it and a SHA-256 of the rank's parameters, buffers and
optimizer state (its own shards). The patches are undone when the job ends (the worker stays).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from torch.distributed.tensor import DTensor

from titanlab.trainer import step as step_module

_fault: dict[str, str | None] = {"now": None}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_digest(trainer) -> str:
    """SHA-256 of this rank's parameter and buffer shards and optimizer state tensors."""
    h = hashlib.sha256()
    tensors = [t for part in trainer.model_parts for t in (*part.parameters(), *part.buffers())]
    for opt in trainer.optimizer.optimizers:
        for state in opt.state.values():
            tensors += [v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    for t in tensors:
        t = _local(t.detach())
        t = torch.view_as_real(t) if t.is_complex() else t
        h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _nan_output(module, args, output):
    return output * float("nan")


def _poisoned_gradient(params: list[torch.nn.Parameter], experts: set[int]) -> torch.Tensor:
    """The local gradient shard the `grad` fault writes into: an expert's if there are any
    (`experts`: the ids of the expert parameters)."""
    with_grad = [p for p in params if p.grad is not None]
    grad = ([p for p in with_grad if id(p) in experts] or with_grad)[0].grad
    assert grad is not None
    return _local(grad)


def pool_main(argv: list[str]) -> int:
    """A warm worker's entry (`tools.lib.rank_pool`): OUT FAULTS, then the trainer's options."""
    from titanlab import train

    out, faults, *options = argv
    at = {int(s): kind for s, kind in (f.split(":") for f in faults.split(",") if f)}
    rank = int(os.environ.get("RANK", "0"))
    record = os.path.join(out, f"rank{rank}.jsonl")
    real_step, real_clip = step_module.TrainStep.train_step, step_module.clip_grad_norm_
    experts: set[int] = set()

    def train_step(self, batches):
        _fault["now"] = at.get(self.step)
        hooks = []
        experts.clear()
        for part in self.model_parts:
            experts.update(id(p) for name, p in part.named_parameters() if "experts" in name)
            if _fault["now"] == "loss" and getattr(part, "tok_embeddings", None) is not None:
                hooks.append(part.tok_embeddings.register_forward_hook(_nan_output))
        try:
            result = real_step(self, batches)
        finally:
            for hook in hooks:
                hook.remove()
            _fault["now"] = None
        with open(record, "a", encoding="utf-8") as f:
            skipped = self.step in self.nonfinite.skipped
            f.write(json.dumps({"step": self.step, "skipped": skipped,
                                "state": state_digest(self)}) + "\n")  # fmt: skip
        return result

    def clip_grad_norm_(params, max_norm, pp_mesh=None):
        if _fault["now"] == "grad" and rank == 0:
            with torch.no_grad():
                _poisoned_gradient(params, experts).view(-1)[0] = float("nan")
        return real_clip(params, max_norm, pp_mesh=pp_mesh)

    os.makedirs(out, exist_ok=True)
    step_module.TrainStep.train_step = train_step  # type: ignore[method-assign]
    step_module.clip_grad_norm_ = clip_grad_norm_  # type: ignore[assignment]
    try:
        return train.main(options)
    finally:
        step_module.TrainStep.train_step = real_step  # type: ignore[method-assign]
        step_module.clip_grad_norm_ = real_clip
