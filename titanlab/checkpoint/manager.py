"""Save and resume a training run with torch.distributed.checkpoint (DCP).

A checkpoint holds the model, the optimizer, the LR scheduler, every data-parallel rank's data
loader position, the step and each rank's RNG state. Model and optimizer are saved as sharded
DTensors, so a checkpoint written under one parallel layout loads under another (DCP reshards).
Per-rank items (loader position, RNG) are keyed by rank and restored when the rank exists.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from titanlab.checkpoint import plain_state, store
from titanlab.checkpoint.loading import CheckpointLoading
from titanlab.config.job_config import Checkpoint, Peft
from titanlab.models.stored_args import write_model_args
from titanlab.peft.lora import is_adapter
from titanlab.peft.qlora import dequantized, is_quantized
from titanlab.peft.stored import write_peft_config


def unwrapped(v: torch.Tensor) -> torch.Tensor:
    """`v` (a tensor or a DTensor) with its values in a plain tensor where a training-time
    wrapper subclass holds them: torchao's float8 FSDP weight (`WeightWithDynamicFloat8CastTensor`)
    keeps its class through `.to` when the dtype does not change, and DCP would store the
    wrapper, which a `weights_only` load (the converter's, transformers') refuses to unpickle.
    The inner tensor comes from the subclass's `__tensor_flatten__` (its first inner name)."""
    local = v.to_local() if isinstance(v, DTensor) else v
    if not is_traceable_wrapper_subclass(local):
        return v
    names, _ = local.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = getattr(local, names[0])
    if not isinstance(v, DTensor):
        return inner
    return DTensor.from_local(
        inner, v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride()
    )


if TYPE_CHECKING:
    from titanlab.models.registry import ModelFamily

logger = logging.getLogger(__name__)
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Checkpointer(CheckpointLoading):
    """Periodic DCP checkpoints under `<dump_folder>/<checkpoint.folder>/step-N`.

    Args:
        cfg: the `[checkpoint]` section.
        dump_folder: `job.dump_folder`; a relative `cfg.folder` is taken inside it.
        model_parts: the model (or the pipeline stages this rank holds).
        optimizer: an `OptimizersContainer` (one optimizer per model part).
        lr_scheduler, dataloader: objects with state_dict / load_state_dict.
        dp_rank: data-parallel index of this rank (keys the loader position).
        family, model_args: the model's family and args; written as `model_args.json` into
            every folder saved, so `convert_checkpoint to-hf` and `checkpoint.initial_load_path`
            know the shape (None: not written).
        tokenizer_path: the run's `model.tokenizer_path` ("" : the bundled one), whose files go
            into the Hugging Face export of `last_save_in_hf`.
        peft: the run's `[peft]` section when LoRA is on (written as `peft.json` into every
            folder saved, for `convert_checkpoint to-peft` / `--merge-lora`), else None. Then
            the step checkpoints hold only the adapter weights of the model
            (with the optimizer and the rest); on resume the frozen base is first loaded from
            `checkpoint.initial_load_path` (else it is the seeded initialization). Model-only
            saves (the seed checkpoint, the final export) keep every weight.
    """

    def __init__(
        self,
        cfg: Checkpoint,
        dump_folder: str,
        *,
        model_parts: list[nn.Module],
        optimizer,
        lr_scheduler,
        dataloader,
        dp_rank: int,
        family: ModelFamily | None = None,
        model_args: Any = None,
        tokenizer_path: str = "",
        peft: Peft | None = None,
    ) -> None:
        self.cfg = cfg
        self.peft = peft
        self.adapters_only = peft is not None
        self.family, self.model_args = family, model_args
        self.tokenizer_path = tokenizer_path
        self.root = store.checkpoint_root(cfg.folder, dump_folder)
        self.model_parts = model_parts
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.dp_rank = dp_rank
        self.rank = dist.get_rank()
        self._pending: tuple[int, Future] | None = None
        self.extra: dict[str, Any] = {}  # `add_state`: more state every checkpoint holds
        self.resumed_from: str | None = None  # the checkpoint `load` resumed
        self._async_pg = None
        if cfg.async_mode == "async":
            # The background write runs its own collectives; keep them off the training groups.
            self._async_pg = dist.new_group(backend="gloo")

    # --- state dicts ---------------------------------------------------------------------
    def _model_sd(self) -> dict:
        """The model's state dict without QLoRA's NF4 base weights (they are rebuilt from
        `initial_load_path` and never loaded from, or saved to, a checkpoint as NF4)."""
        sd: dict = {}
        for part in self.model_parts:
            sd.update(get_model_state_dict(part))
        return {k: v for k, v in sd.items() if not is_quantized(v)}

    def _has_quantized(self) -> bool:
        return any(is_quantized(p) for part in self.model_parts for p in part.parameters())

    def _optim_sd(self) -> dict:
        # Flattened: keys are parameter names, so the state reshards across layouts and stages.
        sd: dict = {}
        for part, opt in zip(self.model_parts, self.optimizer.optimizers):
            sd.update(get_optimizer_state_dict(part, opt, options=_FLAT))
        return sd

    def _full_state(self, step: int) -> dict:
        model = self._model_sd()
        if self.adapters_only:
            model = {k: v for k, v in model.items() if is_adapter(k)}
        return {
            "model": model,
            "optimizer": self._optim_sd(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            # JSON in a uint8 tensor: one per-rank item that loading never unpickles.
            "dataloader": {
                f"dp_rank_{self.dp_rank}": plain_state.encode(self.dataloader.state_dict())
            },
            "rng": {f"rank_{self.rank}": torch.get_rng_state()},
            "train_state": {"step": step},
            **{name: obj.state_dict() for name, obj in self.extra.items()},
        }

    # --- saving --------------------------------------------------------------------------
    def due(self, step: int, last_step: int) -> bool:
        """Whether `maybe_save(step, last_step)` will save: checkpointing is on and `step` is a
        multiple of the interval or the last."""
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == last_step)

    def maybe_save(self, step: int, last_step: int) -> None:
        """Save when checkpointing is on and `step` is a multiple of the interval or the last."""
        if self.due(step, last_step):
            self.save(step)
            if step == last_step and self.cfg.export_at_end:
                self.export(step)

    def save(self, step: int) -> str:
        """Write the full training state of `step` (async when configured). Returns the folder."""
        self.wait()
        path = self._fresh_dir(step)
        begin = time.perf_counter()
        state = self._full_state(step)
        if self._async_pg is not None:
            # With the default (synchronous) stager, async_save returns a plain Future; only an
            # asynchronous stager makes it an AsyncSaveResponse.
            future = cast(
                Future, dcp.async_save(state, checkpoint_id=path, process_group=self._async_pg)
            )
            self._pending = (step, future)
            logger.info(
                "checkpoint: step %d staged in %.2fs, writing to %s in the background",
                step,
                time.perf_counter() - begin,
                path,
            )
        else:
            dcp.save(state, checkpoint_id=path)
            logger.info(
                "checkpoint: saved step %d to %s in %.2fs", step, path, time.perf_counter() - begin
            )
            self._after_complete(step)
        return path

    def save_model_only(
        self, step: int, dtype: torch.dtype = torch.float32, name: str | None = None
    ) -> str:
        """Write only the model weights (cast to `dtype`), e.g. the seed checkpoint (step 0)
        or the final export. Returns the folder."""
        self.wait()
        path = self._fresh_dir(step, name)
        full: dict = {}
        for part in self.model_parts:
            full.update(get_model_state_dict(part))
        # QLoRA: the base as the run used it, NF4 dequantized.
        model = {
            k: dequantized(v, dtype)
            if is_quantized(v)
            else unwrapped(v.to(dtype))
            if v.is_floating_point()
            else v
            for k, v in full.items()
        }
        dcp.save({"model": model, "train_state": {"step": step}}, checkpoint_id=path)
        logger.info("checkpoint: saved model weights (%s) of step %d to %s", dtype, step, path)
        return path

    def export(self, step: int) -> str:
        """The final model-only export in `checkpoint.export_dtype`, at `<root>/export-step-N`;
        with `checkpoint.last_save_in_hf`, rank 0 then converts it to a Hugging Face folder
        `<root>/hf-step-N` (streamed, one tensor at a time; the other ranks do not wait)."""
        dtype = _DTYPES[self.cfg.export_dtype]
        path = self.save_model_only(step, dtype, name=f"export-step-{step}")
        if self.cfg.last_save_in_hf and self.rank == 0:
            from titanlab.checkpoint.convert import dcp_to_hf

            hf_path = os.path.join(self.root, f"hf-step-{step}")
            begin = time.perf_counter()
            assert self.family is not None, "last_save_in_hf needs the model's family"
            dcp_to_hf(
                path,
                hf_path,
                model_name=self.family.name,
                model_args=self.model_args,
                tokenizer_path=self.tokenizer_path or None,
                dtype=dtype,
                overwrite=True,
                progress=False,
            )
            logger.info(
                "checkpoint: wrote the Hugging Face folder %s in %.2fs",
                hf_path,
                time.perf_counter() - begin,
            )
        return path

    def _fresh_dir(self, step: int, name: str | None = None) -> str:
        path = os.path.join(self.root, name) if name else store.step_dir(self.root, step)
        if self.rank == 0:
            store.remove(path)  # a cut-off earlier attempt at this step must not mix in
            os.makedirs(path, exist_ok=True)
            if self.family is not None:
                write_model_args(path, self.family, self.model_args)
            if self.peft is not None:
                write_peft_config(path, self.peft)
        dist.barrier()
        return path

    def wait(self) -> None:
        """Block until a background save has finished, then apply `keep_latest_k`."""
        if self._pending is not None:
            step, future = self._pending
            future.result()
            self._pending = None
            logger.info("checkpoint: background write of step %d finished", step)
            self._after_complete(step)

    def _after_complete(self, step: int) -> None:
        """Rank 0, once the checkpoint of `step` is complete: remove the folders of earlier
        steps whose write never finished (a run killed while saving that then resumed, or
        recovered a later step from a live replica group, past them: nothing will complete
        them), then apply `keep_latest_k` to the complete ones."""
        if self.rank != 0:
            return
        complete = []
        for s in store.list_steps(self.root):
            if s <= 0:
                continue
            if store.incomplete_reason(store.step_dir(self.root, s)) is None:
                complete.append(s)
            elif s < step:
                logger.info("checkpoint: removing %s (its write never finished)",
                            store.step_dir(self.root, s))  # fmt: skip
                store.remove(store.step_dir(self.root, s))
        if self.cfg.keep_latest_k:
            for s in complete[: -self.cfg.keep_latest_k]:
                store.remove(store.step_dir(self.root, s))

    # --- loading -------------------------------------------------------------------------
    def last_complete(self) -> str | None:
        """Folder of the newest complete checkpoint, or None."""
        for s in reversed(store.list_steps(self.root)):
            if store.incomplete_reason(store.step_dir(self.root, s)) is None:
                return store.step_dir(self.root, s)
        return None

    def close(self) -> None:
        """Finish any async save, then end the async-save group once every rank got here
        (called on a clean or preempted exit, which all ranks reach)."""
        self.wait()
        if self._async_pg is not None:
            dist.barrier(group=self._async_pg)
            dist.destroy_process_group(self._async_pg)
            self._async_pg = None
