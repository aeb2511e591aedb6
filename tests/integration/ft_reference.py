"""Single-process references of training across replica groups, on the batches a fault-tolerant
run recorded (`debug.record_batches`), with the real Trainer's step (`Trainer.train_step`: the
loss, clipping, optimizer and LR schedule of the run).

- "quorum": each step trains on the batches of the groups in that step's quorum, concatenated:
  the mean token loss over the groups present, which fault-tolerant HSDP's gradient is.
- "diloco": each group trains its own copy of the weights and optimizer state on its own
  batches; every `sync_steps` steps the pseudo-gradients (the last sync's weights minus each
  group's) are averaged, an outer Nesterov SGD steps the last sync's weights with it, and every
  group continues from them (Douillard et al. 2023, arXiv:2311.08105, Algorithm 1). Streaming
  ("fragments" F, "fragment_update_alpha" α; arXiv:2501.18512): every sync_steps / F steps one
  fragment of the weights in turn, each group then holding (1 - α) × the outer result + α ×
  its own. A group
  that recovered from a live peer at a sync ("recoveries": {step: [group, peer]}) holds the
  peer's weights and optimizer state just before that step's sync.

Run on one warm rank: target `ft_reference:pool_main`, argv = SPEC OUT then the trainer's
options (one process, `training.local_batch_size` the rows of a step's batch). SPEC is JSON:
{"mode", "steps": {step: [[inputs, labels] per group]}, "sync_steps", "outer_lr",
"outer_momentum", "fragments", "fragment_update_alpha", "recoveries"}; OUT gets {"losses": {group: {step: loss}}} ("quorum": group "all").
"""

from __future__ import annotations

import copy
import json
import sys

import torch

from titanlab.config.manager import build_config
from titanlab.distributed.init import destroy_distributed
from titanlab.resilience.diloco import clean_name, fragment_names
from titanlab.trainer import Trainer


def _batch(rows: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    inputs, labels = rows
    return [(torch.tensor(inputs), torch.tensor(labels))]


def _state(trainer: Trainer) -> dict:
    model = trainer.model_parts[0]
    return {
        "params": {clean_name(n): p.detach().clone() for n, p in model.named_parameters()},
        "optimizer": copy.deepcopy(trainer.optimizer.optimizers[0].state_dict()),
        "lr_scheduler": copy.deepcopy(trainer.lr_scheduler.state_dict()),
    }


def _load(trainer: Trainer, state: dict) -> None:
    model = trainer.model_parts[0]
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state["params"][clean_name(n)])
    trainer.optimizer.optimizers[0].load_state_dict(copy.deepcopy(state["optimizer"]))
    trainer.lr_scheduler.load_state_dict(copy.deepcopy(state["lr_scheduler"]))


def quorum(trainer: Trainer, steps: dict[int, list]) -> dict[str, dict[int, float]]:
    losses = {}
    for step in sorted(steps):
        groups = steps[step]
        rows = [[row for g in groups for row in g[0]], [row for g in groups for row in g[1]]]
        trainer.step = step
        loss, _ = trainer.train_step(_batch(rows))
        losses[step] = loss.item()
    return {"all": losses}


def diloco(trainer: Trainer, spec: dict) -> dict[str, dict[int, float]]:
    steps = {int(s): b for s, b in spec["steps"].items()}
    count = len(next(iter(steps.values())))
    states = [_state(trainer) for _ in range(count)]
    synced = {n: p.clone() for n, p in states[0]["params"].items()}
    fragments = fragment_names(trainer.model_parts[0], spec.get("fragments", 1))
    outers = [torch.optim.SGD([synced[n] for n in names], lr=spec["outer_lr"],
                              momentum=spec["outer_momentum"], nesterov=True)
              for names in fragments]  # fmt: skip
    every, alpha = spec["sync_steps"] // len(fragments), spec.get("fragment_update_alpha", 0.0)
    losses: dict[str, dict[int, float]] = {str(g): {} for g in range(count)}
    recoveries = {int(s): pair for s, pair in spec.get("recoveries", {}).items()}
    for step in sorted(steps):
        for g in range(count):
            _load(trainer, states[g])
            trainer.step = step
            loss, _ = trainer.train_step(_batch(steps[step][g]))
            losses[str(g)][step] = loss.item()
            states[g] = _state(trainer)
        if step in recoveries:
            group, peer = recoveries[step]
            states[group] = copy.deepcopy(states[peer])
        if step % every == 0:  # the fragments in turn
            f = (step // every - 1) % len(fragments)
            for n in fragments[f]:
                synced[n].grad = sum(synced[n] - s["params"][n] for s in states) / count
            outers[f].step()
            for s in states:  # (1 - α) × the outer result + α × the group's own
                for n in fragments[f]:
                    s["params"][n] = synced[n].detach().lerp(s["params"][n], alpha)
    return losses


def pool_main(argv: list[str]) -> int:
    """A warm worker's entry (`tools.lib.rank_pool`): SPEC OUT, then the trainer's options."""
    spec_path, out, *options = argv
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    trainer = Trainer(build_config(options))
    try:
        if spec["mode"] == "quorum":
            losses = quorum(trainer, {int(s): b for s, b in spec["steps"].items()})
        else:
            losses = diloco(trainer, spec)
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"losses": losses}, f)
    finally:
        destroy_distributed(barrier=False)
    return 0


if __name__ == "__main__":
    sys.exit(pool_main(sys.argv[1:]))
