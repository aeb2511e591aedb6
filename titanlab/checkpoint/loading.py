"""Resuming from a checkpoint: which step folder to load (the newest complete one, or
`checkpoint.load_step`), the weights of `checkpoint.initial_load_path` otherwise, a LoRA run's
frozen base before its adapters, and the data-loader state as plain data. `CheckpointLoading`
is the half of `titanlab.checkpoint.Checkpointer` that loads; the Checkpointer builds what it
reads."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlab.checkpoint import plain_state, store
from titanlab.config.job_config import Checkpoint, ConfigError
from titanlab.peft.lora import is_adapter

logger = logging.getLogger("titanlab.checkpoint.manager")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointLoading:
    """`load` over the attributes the Checkpointer sets."""

    cfg: Checkpoint
    root: str
    rank: int
    dp_rank: int
    adapters_only: bool
    model_parts: list
    optimizer: Any
    lr_scheduler: Any
    dataloader: Any
    _model_sd: Callable[[], dict]
    _optim_sd: Callable[[], dict]
    _has_quantized: Callable[[], bool]
    extra: dict[str, Any]
    resumed_from: str | None

    def _choose(self, warn: bool = True) -> str | None:
        if self.cfg.load_step >= 0:
            return store.load_step_path(self.root, self.cfg.load_step)
        for s in reversed(store.list_steps(self.root)):
            path = store.step_dir(self.root, s)
            reason = store.incomplete_reason(path)
            if reason is None:
                return path
            if warn and self.rank == 0:
                logger.warning("checkpoint: skipping incomplete %s: %s", path, reason)
        return None

    def _source(self, warn: bool = True) -> tuple[str | None, bool]:
        """(the folder `load` reads, whether only its model weights are taken): the newest
        complete checkpoint (or `checkpoint.load_step`), else `checkpoint.initial_load_path`;
        with `checkpoint.enable = false`, only the latter. Raises ConfigError for a
        `load_step` or an `initial_load_path` that cannot be loaded."""
        path = self._choose(warn) if self.cfg.enable else None
        if path is not None or not self.cfg.initial_load_path:
            return path, False
        path = self.cfg.initial_load_path
        reason = store.incomplete_reason(path) if os.path.isdir(path) else "it does not exist"
        if reason:
            raise ConfigError(f"checkpoint.initial_load_path={path!r} cannot be loaded: {reason}")
        return path, self.cfg.initial_load_model_only

    def loads_every_weight(self) -> bool:
        """Whether `load` will replace every model weight but LoRA's adapters (which
        `init_adapters` sets): the run then skips its random initialization, as Hugging Face's
        `from_pretrained` skips the weights it loads. False where `load` would raise, or would
        leave a weight to the initialization (a LoRA checkpoint of adapters alone, without
        `initial_load_path` to take the frozen base from)."""
        try:
            path, _ = self._source(warn=False)
        except ConfigError:
            return False
        if path is None:
            return False
        keys = store.saved_keys(path)
        if all(f"model.{k}" in keys for k in self._model_sd() if not is_adapter(k)):
            return True
        # An adapter checkpoint: `load` takes the frozen base from initial_load_path, whole.
        has_optim = any(k.startswith("optimizer.") for k in keys)
        return self.adapters_only and has_optim and bool(self.cfg.initial_load_path)

    def load(self) -> int:
        """Restore the newest complete checkpoint (or `checkpoint.load_step`), else the weights
        of `checkpoint.initial_load_path`; with `checkpoint.enable = false`, only the latter.

        Returns the step it holds (0 when there is none, or for a model-only seed checkpoint).
        Raises ConfigError when `load_step` names a missing or incomplete checkpoint.
        """
        # With checkpointing off nothing is resumed, but the initial weights are still loaded.
        path, model_only = self._source()
        if path is None:
            return 0
        keys = store.saved_keys(path)
        has_optim = not model_only and any(k.startswith("optimizer.") for k in keys)
        if self.adapters_only and has_optim and self.cfg.initial_load_path:
            self._load_base(self.cfg.initial_load_path)  # the frozen base, then the adapters
        model_sd = self._model_sd()
        saved = {k for k in model_sd if f"model.{k}" in keys}
        missing = [k for k in model_sd if k not in saved]
        # An adapter checkpoint lacks the base; a base checkpoint lacks the adapters.
        allowed = (lambda k: not is_adapter(k)) if has_optim else is_adapter
        if missing and not (self.adapters_only and all(allowed(k) for k in missing)):
            raise ConfigError(
                f"{path}: holds no model.{missing[0]} ({len(missing)} model tensors missing); "
                "it is not a checkpoint of this model"
            )
        state: dict = {
            "model": {k: v for k, v in model_sd.items() if k in saved},
            "train_state": {"step": 0},
        }
        if has_optim:
            state["optimizer"] = self._optim_sd()
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
            # A loader position saved under another data-parallel layout is converted by the
            # sampler; any saved rank's position serves (all ranks consumed the same count).
            loader_key = f"dp_rank_{self.dp_rank}"
            if f"dataloader.{loader_key}" not in keys:
                loader_key = "dp_rank_0"
            state["dataloader"] = {loader_key: _loader_buffer(path, f"dataloader.{loader_key}")}
            if f"rng.rank_{self.rank}" in keys:
                state["rng"] = {f"rank_{self.rank}": torch.get_rng_state()}
        part_keys = [list(get_model_state_dict(part)) for part in self.model_parts]
        dcp.load(state, checkpoint_id=path)
        for part, fqns in zip(self.model_parts, part_keys):
            set_model_state_dict(
                part,
                {k: state["model"][k] for k in fqns if k in saved},
                options=StateDictOptions(strict=not missing and not self._has_quantized()),
            )
        if has_optim:
            for part, opt in zip(self.model_parts, self.optimizer.optimizers):
                set_optimizer_state_dict(part, opt, state["optimizer"], options=_FLAT)
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            try:
                loader_state = plain_state.decode(state["dataloader"][loader_key])
            except ValueError as e:
                raise ConfigError(
                    f"{path}: the data-loader state dataloader.{loader_key} is not "
                    f"plain data ({e}); refusing to load it"
                ) from None
            self.dataloader.load_state_dict(loader_state)
            if "rng" in state:
                torch.set_rng_state(state["rng"][f"rank_{self.rank}"])
        step = int(state["train_state"]["step"]) if has_optim else 0
        self.resumed_from = path if has_optim else None
        logger.info(
            "checkpoint: loaded %s (step %d%s)", path, step, "" if has_optim else ", model only"
        )
        return step

    def add_state(self, name: str, obj: Any) -> bool:
        """Save `obj.state_dict()` (tensors and DTensors, as DCP takes them) under `name` in
        every checkpoint from now on, and load it into `obj` (`obj.load_state_dict`) now when
        the checkpoint `load` resumed holds it. Returns whether it was loaded."""
        self.extra[name] = obj
        path = self.resumed_from
        if path is None or not any(k.startswith(f"{name}.") for k in store.saved_keys(path)):
            return False
        state = {name: obj.state_dict()}
        dcp.load(state, checkpoint_id=path)
        obj.load_state_dict(state[name])
        logger.info("checkpoint: loaded %s of %s", name, path)
        return True

    def _load_base(self, path: str) -> None:
        """Load the non-adapter model weights of `path` (a LoRA run's frozen base)."""
        keys = store.saved_keys(path)
        base = {k: v for k, v in self._model_sd().items() if not is_adapter(k)}
        absent = [k for k in base if f"model.{k}" not in keys]
        if absent:
            raise ConfigError(
                f"checkpoint.initial_load_path={path!r} holds no model.{absent[0]}; it is not "
                "a checkpoint of this model's base"
            )
        part_keys = [list(get_model_state_dict(part)) for part in self.model_parts]
        state = {"model": base}
        dcp.load(state, checkpoint_id=path)
        for part, fqns in zip(self.model_parts, part_keys):
            set_model_state_dict(
                part,
                {k: state["model"][k] for k in fqns if k in base},
                options=StateDictOptions(strict=False),
            )
        logger.info("checkpoint: loaded the base weights of %s", path)


def _loader_buffer(path: str, key: str) -> torch.Tensor:
    """An empty uint8 tensor the size of the stored data-loader state `key`, for DCP to load
    into. Raises ConfigError for a checkpoint whose loader state is not such a tensor (older
    titanlab pickled it, and DCP would unpickle it on load, which can run code)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(path).read_metadata().state_dict_metadata.get(key)
    if (
        not isinstance(meta, TensorStorageMetadata)
        or meta.properties.dtype != torch.uint8
        or len(meta.size) != 1
    ):
        raise ConfigError(
            f"{path}: the data-loader state {key} is not plain data (a pickle, as written before "
            "titanlab stored it as JSON); refusing to load it because unpickling can run code. "
            "To start from its weights only: --checkpoint.initial_load_path "
            + path
            + " --checkpoint.initial_load_model_only true in an empty dump folder"
        )
    return torch.empty(meta.size, dtype=torch.uint8)
