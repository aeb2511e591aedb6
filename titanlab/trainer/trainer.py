"""The Trainer: the recipe of one training run, in the order it runs.

build data → build the model on the meta device (float8, LoRA) → parallelize (or split into
pipeline stages) → teacher → optimizer and LR schedule → checkpointer (initialize or load) →
metrics → the loop. One step of the loop: get batch → forward/backward per microbatch
(`titanlab.trainer.step`) → clip → optimizer step → log → maybe validate and checkpoint.
`python -m titanlab.train` (`titanlab/train.py`) runs it.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import socket
import time
from typing import Any

import torch

from titanlab.config.performance import fused_loss, loss_description
from titanlab.checkpoint import Checkpointer, store
from titanlab.components import builders as components
from titanlab.components.loss import ScaledLoss, build_loss_fn
from titanlab.components.optim import LRSchedulersContainer, OptimizersContainer
from titanlab.config.dump import compact_config, write_config_toml
from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.data.batches import BatchPreparer
from titanlab.data.build import build_data, build_loader
from titanlab.distributed.comm_counter import count_step_comms
from titanlab.distributed.init import init_distributed, set_train_timeout
from titanlab.distributed.parallelize import loss_parallel_enabled, param_dtype, parallelize_model
from titanlab.distributed.parallelize import tp_grid_loss
from titanlab.distributed.pipeline import pipeline_model
from titanlab.metrics import MetricsLogger, device_peak_flops
from titanlab.metrics.build import build_sinks
from titanlab.models.common.decoder import Decoder, count_active_params, count_params
from titanlab.observability import warning_filters
from titanlab.observability.profiling import StepProfiler
from titanlab.observability.run_summary import end_of_run
from titanlab.components.fused_head import use_fused_loss
from titanlab.components.fused_pipeline import returned_loss, take_labels
from titanlab.components.liger import apply_liger
from titanlab.peft.lora import init_adapters
from titanlab.peft.qlora import to_empty_keeping_quantized
from titanlab.planning import preflight
from titanlab.planning.memory import local_world_size
from titanlab.posttrain.distill import PipelineDistillLoss
from titanlab.posttrain.teacher import build_teacher, join_teacher_load, teacher_args
from titanlab.precision.float8 import apply_float8
from titanlab.resilience.failures import OutOfMemory, TrainingDiverged, is_out_of_memory, oom_line
from titanlab.resilience.preemption import REQUEUE_EXIT_CODE, Preempted, PreemptionHandler
from titanlab.trainer import peft_steps, rl_steps
from titanlab.trainer.step import TrainStep

logger = logging.getLogger("titanlab")


class Trainer(TrainStep):
    """Owns the model parts, optimizer, data and checkpointer of one run; `train()` runs the
    loop. Raises ConfigError (one line) before any process group exists when the config cannot
    run (`titanlab.planning.preflight`)."""

    loader: Any  # the token-window loader, or a reinforcement-learning run's prompt stream

    def __init__(self, config: JobConfig) -> None:
        warning_filters.install()
        self.config = config
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        # Everything that can be checked without a process group is checked first.
        plan = preflight.check(config, world_size, local_world_size())
        self.parallel_dims, self.batch = plan.parallel_dims, plan.batch
        self.tokenizer, self.family, self.model_args = plan.tokenizer, plan.family, plan.model_args
        self.device, self.rank, _ = init_distributed(config.comm.init_timeout_seconds)
        self._log_start(world_size)
        self._set_determinism()
        self.parallel_dims.build_mesh(self.device.type)

        self._build_data()
        model, flops_per_token = self._build_model()
        compute_dtype = param_dtype(config, self.device)
        peft_steps.adapt(model, config, compute_dtype)
        if fused_loss(config):
            use_fused_loss(model, config.loss.chunk_size)
        logger.info("loss: %s", loss_description(config, self.model_args.vocab_size))
        if config.kernels.liger:
            logger.info("kernels: Liger on %d modules", apply_liger(model))
        rl_steps.adapt(model, config)
        parallelize = self._parallelize(model)
        self._build_teacher(parallelize)
        self.reference = rl_steps.reference(self, parallelize)
        peft_steps.after_parallelize(self.model_parts, config, self.rank, compute_dtype)
        self.optimizer = OptimizersContainer(
            self.model_parts, config.optimizer, self.device,
            allow_fused=compute_dtype != torch.float16,
        )  # fmt: skip
        self.lr_scheduler = LRSchedulersContainer(
            self.optimizer, config.lr_scheduler, config.training.steps
        )
        self._build_checkpointer(world_size)
        self.step = 0 if config.checkpoint.create_seed_checkpoint else self.checkpointer.load()
        self._build_metrics(world_size, flops_per_token)
        self.init_step_state(compute_dtype)
        self.rl = rl_steps.recipe(self)

    # --- the recipe's parts, in order ---------------------------------------------------
    def _log_start(self, world_size: int) -> None:
        if self.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        if self.rank == 0:
            logger.info("%s", compact_config(self.config, write_config_toml(self.config)))
        logger.info(
            "distributed: world size %d = %d node(s) × %d rank(s), backend %s, rank 0 on %s, "
            "restart %s",
            world_size,
            world_size // local_world_size(),
            local_world_size(),
            torch.distributed.get_backend() if torch.distributed.is_initialized() else "none",
            socket.gethostname(),
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        )

    def _build_data(self) -> None:
        """The train and held-out splits, the batch preparer and the train loader."""
        config, dims = self.config, self.parallel_dims
        dp_rank, dp = dims.dp_rank(), dims.dp_degree
        if config.rl.algorithm != "none":  # prompts instead of token windows
            self.val_set = self.data_schedule = None
            self.loader = rl_steps.data_stream(self)
            return
        data = build_data(config, self.tokenizer)
        train_set, self.val_set = data.train, data.val
        self.batches = BatchPreparer(config, data.masking, self.rank, dp_rank)
        self.data_schedule = data.schedule
        self.loader = build_loader(
            train_set, config, dp_rank, dp, self.batch.global_batch_size, data.schedule
        )
        if self.val_set is not None and (len(self.val_set) < dp or dims.pp_enabled):
            logger.warning(
                "validation: off (%s)",
                "not run under pipeline parallel"
                if dims.pp_enabled
                else f"only {len(self.val_set)} held-out windows "
                f"for {dp} data-parallel ranks; raise data.val_fraction",
            )
            self.val_set = None
        logger.info(
            "data: %s, %d train windows of %d tokens; batch: %s",
            data.description,
            len(train_set),
            config.training.seq_len,
            self.batch,
        )

    def _build_model(self) -> tuple[Decoder, int]:
        """The model on the meta device with float8 Linears; returns it and its training
        FLOPs per token (an MoE token counts its active parameters only)."""
        config, dims = self.config, self.parallel_dims
        model = components.build_meta_model(self.model_args)
        nparams, active = count_params(model), count_active_params(model)
        flops_per_token = self.family.flops_per_token(
            self.model_args,
            config.training.seq_len,
            count_active_params(model, exclude_embedding=True),
        )
        logger.info(
            "model: %s %s, %s parameters%s, %.3e training FLOPs/token; layout: %s",
            self.family.name,
            config.model.flavor,
            f"{nparams:,}",
            f" ({active:,} active per token)" if active != nparams else "",
            flops_per_token,
            dims,
        )
        apply_float8(model, config.float8, self.device, dims.fsdp_enabled)
        return model, flops_per_token

    def _parallelize(self, model: Decoder):
        """Apply the layout: one model part, or this rank's pipeline stages and their schedule.
        Returns the parallelize function (the teacher gets the same one)."""
        config, dims = self.config, self.parallel_dims
        self.loss_parallel = loss_parallel_enabled(config, dims)
        compile_loss = config.compile.enable and "loss" in config.compile.components
        self.loss_fn = tp_grid_loss(build_loss_fn(compile_loss, self.loss_parallel), dims)
        parallelize = functools.partial(
            parallelize_model, parallel_dims=dims, config=config, device=self.device
        )
        prepare = peft_steps.parallelize_fn(parallelize, config, dims, self.device)
        self.schedule = None
        self.pp_loss = None
        if dims.pp_enabled:
            d = config.distill
            fused = fused_loss(config)  # the last stage ends in the loss
            self.pp_loss = (
                PipelineDistillLoss(d.alpha, d.temperature)
                if d.teacher_path
                else ScaledLoss(returned_loss if fused else self.loss_fn)
            )
            self.schedule, self.model_parts, self.has_first, self.has_last = pipeline_model(
                model, dims, config, self.device, prepare, self.pp_loss
            )
            if fused:
                for part in self.model_parts:
                    take_labels(part)
        else:
            prepare(model)
            to_empty_keeping_quantized(model, self.device)
            self.model_parts, self.has_first, self.has_last = [model], True, True
        return parallelize

    def _build_teacher(self, parallelize) -> None:
        """Distillation's teacher, on the ranks that compute the loss (under PP the last stage,
        which runs it per microbatch); other ranks only join its collective load."""
        config = self.config
        self.teacher = None
        if config.distill.teacher_path and self.has_last:  # refused under CP
            args = teacher_args(config, self.family, self.model_args.vocab_size)
            self.teacher = build_teacher(config, args, self.device, parallelize)
            if isinstance(self.pp_loss, PipelineDistillLoss):
                self.pp_loss.teacher = self.teacher
        elif config.distill.teacher_path:
            join_teacher_load(config)

    def _build_checkpointer(self, world_size: int) -> None:
        """The checkpointer, then the initial weights (a checkpoint, when found, replaces them
        in `Checkpointer.load`)."""
        config = self.config
        self.checkpointer = Checkpointer(
            config.checkpoint,
            config.job.dump_folder,
            model_parts=self.model_parts,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.loader,
            dp_rank=self.parallel_dims.dp_rank(),
            family=self.family,
            # What the checkpoints record: the model's context length, not the training one.
            model_args=dataclasses.replace(
                self.model_args,
                max_seq_len=components.context_length(config, self.tokenizer.vocab_size),
            ),
            tokenizer_path=config.model.tokenizer_path,
            peft=config.peft if config.peft.method == "lora" else None,
        )
        components.init_model_weights(
            self.model_parts, self.model_args, self.device, config.debug.seed, world_size
        )
        if config.peft.method == "lora":
            init_adapters(self.model_parts, config.debug.seed)
        rl_steps.init_weights(self.model_parts, config)

    def _build_metrics(self, world_size: int, flops_per_token: int) -> None:
        config = self.config
        self.metrics = MetricsLogger(
            device=self.device,
            rank=self.rank,
            log_freq=config.metrics.log_freq,
            tokens_per_step=self.batch.global_batch_size * config.training.seq_len,
            samples_per_step=self.batch.global_batch_size,
            world_size=world_size,
            flops_per_token=flops_per_token,
            peak_flops=device_peak_flops(self.device, config.metrics.peak_flops),
            sinks=build_sinks(config, self.step) if self.rank == 0 else [],
        )

    def _set_determinism(self) -> None:
        torch.manual_seed(self.config.debug.seed)
        if self.config.debug.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False

    # --- the loop ------------------------------------------------------------------------
    def train(self) -> None:
        cfg = self.config
        if cfg.checkpoint.create_seed_checkpoint:
            return self._write_seed_checkpoint()
        gc.disable()
        preemption = PreemptionHandler(self.device)
        data = iter(self.loader) if self.rl is None else None
        last = cfg.training.steps
        logger.info("training: steps %d → %d", self.step + 1, last)
        first, begin = self.step, time.perf_counter()
        with StepProfiler(cfg.profiling, cfg.job.dump_folder, self.rank, self.device) as prof:
            while self.step < last:
                try:
                    with prof.annotate(self.step + 1):
                        self._loop_step(data, last, preemption)
                except Exception as e:
                    if not is_out_of_memory(e):
                        raise
                    line = oom_line(self.rank, self.step, prof.oom_snapshot())
                    raise OutOfMemory(line) from e
                prof.step(self.step)
        preemption.restore()
        logger.info("training: done at step %d", self.step)
        if self.rank == 0:
            self._finish_run(first, time.perf_counter() - begin)

    def _loop_step(self, data, last: int, preemption: PreemptionHandler) -> None:
        """One iteration of the loop: train, log, validate, checkpoint, maybe stop."""
        cfg = self.config
        self.step += 1
        self.metrics.begin_step()
        lr = self.lr_scheduler.get_last_lr()[0]  # the lr this step uses
        evaluate = False
        if self.rl is not None:
            self.metrics.data_ready()
            loss, grad_norm, extra, evaluate = rl_steps.step(self.rl, cfg, self.step, last)
        else:
            batches = [next(data) for _ in range(self.batch.grad_accum_steps)]
            self.metrics.data_ready()
            self.batches.record(self.step, batches)
            with count_step_comms(self.step):  # only when TITANLAB_COMM_COUNT is set
                loss, grad_norm = self.train_step(batches)
            extra = self.moe_metrics
        if self.step == 1:
            set_train_timeout(cfg.comm.train_timeout_seconds)
        validate = (
            cfg.validation.enable
            and self.val_set is not None
            and self.step % cfg.validation.freq == 0
        )
        log = validate or evaluate or self.metrics.should_log(self.step, last)
        stop = self.step < last and preemption.should_stop()
        # The host waits for the device only when it needs the values: to log, or before
        # anything that must not happen after a non-finite loss (a checkpoint, the end).
        fetch = log or stop or self.step == last or self.checkpointer.due(self.step, last)
        diverged = self.metrics.end_step(
            self.step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            extra=extra,
            loss_scale=self.scaler.get_scale() if self.scaler is not None and fetch else None,
            fetch=fetch,
        )
        if diverged is not None:
            self._diverged(diverged.step, diverged.values["loss"])
        if log:
            self.metrics.log(
                self.step,
                val_loss=self.validate() if validate else None,
                data_tokens=self._mixture_tokens(),
            )
        self.checkpointer.maybe_save(self.step, last)
        if cfg.training.gc_freq and self.step % cfg.training.gc_freq == 0:
            gc.collect(1)
        if stop:
            self._stop_for_preemption(preemption)

    def _mixture_tokens(self) -> dict[str, int] | None:
        """Tokens each source of a mixture has supplied by the end of this step (None for
        one source)."""
        if self.data_schedule is None:
            return None
        samples = self.loader.sampler.consumed_after_step(self.step)
        if samples is None:
            return None
        return {name: n * self.config.training.seq_len for name, n in samples.items()}

    def _finish_run(self, first: int, wall_s: float) -> None:
        """Rank 0: draw the curves (metrics.save_plot), give the trackers the summary and the
        plot, and print the summary."""
        self.checkpointer.wait()
        summary = end_of_run(self.config, self.metrics, self.checkpointer, self.device, first,
                             self.step, wall_s)  # fmt: skip
        self.metrics.artifacts(summary, [os.path.join(self.config.job.dump_folder, "loss.png")])
        self.metrics.close()  # trackers flush and finish before the summary is printed
        logger.info("%s", summary)

    def _diverged(self, step: int, loss: float) -> None:
        last = self.checkpointer.last_complete()
        raise TrainingDiverged(
            f"loss is {loss} at step {step}; last complete checkpoint: "
            f"{last or 'none'} (lower optimizer.lr or check the data)"
        )

    def _stop_for_preemption(self, preemption: PreemptionHandler) -> None:
        """Save the state of the step just finished (unless already saved) and leave the loop."""
        saved = "checkpointing is disabled, nothing saved"
        if self.config.checkpoint.enable:
            path = store.step_dir(self.checkpointer.root, self.step)
            if store.incomplete_reason(path) is not None:
                self.checkpointer.save(self.step)
            self.checkpointer.wait()
            saved = f"checkpoint {path}"
        if self.rank == 0:
            preemption.mark_for_requeue(self.step)
        logger.warning(
            "preempted by %s after step %d: %s; exiting with %d to be requeued",
            preemption.signal_name(),
            self.step,
            saved,
            REQUEUE_EXIT_CODE,
        )
        raise Preempted()

    def _write_seed_checkpoint(self) -> None:
        if self.parallel_dims.world_size != 1:
            raise ConfigError(
                f"checkpoint.create_seed_checkpoint needs 1 process, not "
                f"{self.parallel_dims.world_size} (run with NGPU=1)"
            )
        path = self.checkpointer.save_model_only(0)
        logger.info("seed checkpoint written to %s", path)

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()
