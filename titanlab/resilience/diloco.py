"""DiLoCo across replica groups (`fault_tolerance.semi_sync_method = "diloco"`): torchft's
`DiLoCo` over the model, and its state as a checkpoint holds it.

Each group steps its own inner optimizer (the run's AdamW or Muon) on its own batches; after
every `sync_steps`-th inner step, torchft's hook on the inner optimizer forms a quorum, averages
the pseudo-gradients (the weights of the last sync minus this group's) over it, and steps the
outer Nesterov SGD on the weights of the last sync, which every group then continues from
(Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105, Algorithm 1; torchft's `torchft.local_sgd.DiLoCo`).

Streaming DiLoCo (`fault_tolerance.fragments` > 1; Douillard et al. 2025, arXiv:2501.18512)
splits the model into fragments of consecutive blocks and syncs one every sync_steps /
fragments inner steps, in turn (torchft's DiLoCo over several model fragments, each with its
own outer optimizer).

Besides the model and the inner optimizer, a resumed run needs the outer state: the weights of
the last sync (torchft keeps them in host memory), the outer optimizer's momentum, and how many
inner steps have passed since the last sync. `DiLoCoState` gives the first two to the
checkpoint (DTensors laid out as the parameters, so they reshard like the model) and takes them
back; the third is the step modulo `sync_steps`. A group recovering from a live peer receives
them through torchft's own transfer (the fragment's registered state).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlab.config.device_path import device_type
from titanlab.config.errors import ConfigError
from titanlab.config.fault_tolerance import FaultTolerance

_WRAPPERS = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"}


def clean_name(name: str) -> str:
    """A parameter's name without the wrappers' parts (activation checkpointing, compile):
    the name of the model's state dict."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def _unit(name: str) -> str:
    """The block a parameter belongs to: `layers.<i>` for a transformer block's, else the
    model's child that holds it (the embedding, the final norm, the output)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def fragment_names(model: nn.Module, count: int) -> list[list[str]]:
    """The parameter names (`clean_name`) of each of `count` fragments: consecutive blocks in
    the model's order, cut where the running parameter count (global shapes) passes each
    1/count of the total, every fragment at least one block. A weight tied to another is in
    the fragment of its first name. Raises ConfigError with fewer blocks than fragments."""
    units: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for name, p in model.named_parameters():  # tied weights once, under the first name
        name = clean_name(name)
        units.setdefault(_unit(name), []).append(name)
        sizes[_unit(name)] = sizes.get(_unit(name), 0) + p.numel()
    if len(units) < count:
        raise ConfigError(
            f"fault_tolerance.fragments={count} is more than the model's {len(units)} blocks "
            "(embedding, transformer blocks, norm and output); use at most that many"
        )
    order = list(units)
    cum = [0]
    for unit in order:
        cum.append(cum[-1] + sizes[unit])
    bounds = [0]
    for k in range(1, count):  # the k-th cut: where the running count passes k/count
        i = bounds[-1] + 1
        while i < len(order) - (count - k) and cum[i] < k * cum[-1] / count:
            i += 1
        bounds.append(i)
    bounds.append(len(order))
    return [[n for unit in order[lo:hi] for n in units[unit]] for lo, hi in zip(bounds, bounds[1:])]


class _Fragment(nn.Module):
    """Some of the model's parameters (the same objects), for torchft to sync as one fragment;
    named by `clean_name` with "/" for ".", which a module's parameter name cannot hold."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        super().__init__()
        for name, p in params.items():
            self.register_parameter(name.replace(".", "/"), p)


class DiLoCoState:
    """torchft's DiLoCo over `model`, entered (its hooks on `inner`), and its outer state.

    Args:
        manager: this rank's torchft `Manager` (synchronous quorum).
        cfg: the `[fault_tolerance]` section (sync_steps, outer_lr, outer_momentum, fragments,
            fragment_update_alpha).
        model: the model (one part: fault tolerance refuses pipeline stages).
        inner: the run's optimizer of that part.
        device: this rank's device (the host copy of the last sync's weights is pinned on CUDA).
    Raises:
        ConfigError: more fragments than the model has blocks.
    """

    def __init__(
        self,
        manager,
        cfg: FaultTolerance,
        model: nn.Module,
        inner: torch.optim.Optimizer,
        device: torch.device,
    ) -> None:
        from torchft.local_sgd import DiLoCo

        self.every = cfg.sync_steps // cfg.fragments  # inner steps between two fragment syncs
        params = {clean_name(n): p for n, p in model.named_parameters()}
        self.fragments = [
            _Fragment({n: params[n] for n in names})
            for names in fragment_names(model, cfg.fragments)
        ]
        self.outer = [
            torch.optim.SGD(f.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                            nesterov=cfg.outer_momentum > 0)  # momentum 0: plain SGD
            for f in self.fragments
        ]  # fmt: skip
        self._diloco = DiLoCo(
            manager, self.fragments, inner, self.outer, sync_every=cfg.sync_steps,
            pin_memory=device_type(device) == "cuda",
            fragment_update_alpha=cfg.fragment_update_alpha,
        ).__enter__()  # fmt: skip

    def resume(self, step: int) -> None:
        """Continue after training step `step`: the fragment syncs done (torchft's manager
        counts them, and picks the next fragment by that count) and the inner steps since the
        last (`sync_steps / fragments` steps apart; torchft counts both from 0 when built)."""
        self._diloco._manager.load_state_dict({"step": step // self.every, "batches_committed": 0})
        self._diloco._local_step = step % self.every

    def close(self) -> None:
        self._diloco.__exit__(None, None, None)

    # --- the checkpoint's "diloco" entry -------------------------------------------------
    def _outer_state(self):
        """(name, parameter, the last sync's weights in host memory, outer optimizer) of every
        parameter, by `clean_name`."""
        for fragment, outer, synced in zip(
            self.fragments, self.outer, (f.original_parameters for f in self._diloco._fragments)
        ):
            for key, p in fragment.named_parameters():
                yield key.replace("/", "."), p, synced[key], outer

    def state_dict(self) -> dict[str, Any]:
        """{"synced": the last sync's weights, "momentum": the outer SGD's momentum buffers},
        each by parameter name, placed as the parameter (a DTensor shard where it is one; on
        its device, so a save briefly holds one more copy of this rank's weights there).
        Before the first sync the momentum is zeros, which the first outer step treats as it
        treats none (torch.optim.SGD: buf = momentum * 0 + grad)."""
        synced: dict[str, torch.Tensor] = {}
        momentum: dict[str, torch.Tensor] = {}
        for name, p, host, outer in self._outer_state():
            if isinstance(p, DTensor):
                synced[name] = DTensor.from_local(
                    host, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
            else:
                synced[name] = host.to(p.device)
            buf = outer.state.get(p, {}).get("momentum_buffer")
            momentum[name] = buf if buf is not None else torch.zeros_like(p.detach())
        return {"synced": synced, "momentum": momentum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's `state_dict()` (DCP loads into one from `state_dict`)."""
        with torch.no_grad():
            for name, p, host, outer in self._outer_state():
                value = state["synced"][name]
                host.copy_(value.to_local() if isinstance(value, DTensor) else value)
                outer.state[p]["momentum_buffer"] = state["momentum"][name]
