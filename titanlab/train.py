"""Train a model of the registry: `python -m titanlab.train --job.config_file FILE.toml [--section.key V ...]`.

Launch several processes with torchrun (see run_train.sh). One training step is:
get batch → forward/backward (per microbatch) → clip → optimizer step → log → maybe checkpoint.
"""

from __future__ import annotations

import dataclasses

import functools
import gc
import logging
import os
import socket
import sys
import time

import torch

from titanlab import components, preflight
from titanlab.data.build import build_data, build_loader
from titanlab.data.batches import BatchPreparer
from titanlab.distill import PipelineDistillLoss, distillation_loss_sum
from titanlab.peft import setup as peft_setup
from titanlab.peft.lora import init_adapters
from titanlab.peft.qlora import to_empty_keeping_quantized
from titanlab.teacher import build_teacher, join_teacher_load, teacher_args
from titanlab.checkpoint import Checkpointer, store
from titanlab.config.docs import format_help
from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.config.dump import compact_config, write_config_toml
from titanlab.config.manager import build_config
from titanlab.distributed import moe_stats
from titanlab.distributed.comm_counter import count_step_comms
from titanlab.distributed.init import (
    destroy_distributed,
    exit_process,
    init_distributed,
    set_train_timeout,
)
from titanlab.distributed.context_parallel import cp_context
from titanlab.distributed.parallelize import (
    loss_parallel_enabled,
    param_dtype,
    parallelize_model,
)
from titanlab.distributed.pipeline import pipeline_model
from titanlab.failures import (
    CONFIG_ERROR_EXIT_CODE,
    DIVERGED_EXIT_CODE,
    HANG_EXIT_CODE,
    OOM_EXIT_CODE,
    OutOfMemory,
    TrainingDiverged,
    fail,
    is_collective_timeout,
    is_out_of_memory,
    oom_line,
    timeout_line,
)
from titanlab.float8 import apply_float8, precompute_scales
from titanlab.preemption import REQUEUE_EXIT_CODE, Preempted, PreemptionHandler
from titanlab.profiling import StepProfiler
from titanlab.precision import autocast_context, build_grad_scaler
from titanlab.loss import IGNORE_INDEX, ScaledLoss, build_loss_fn, local_value, maybe_loss_parallel
from titanlab.distributed.utils import clip_grad_norm_, global_sum
from titanlab.memory import local_world_size
from titanlab.metrics import MetricsLogger, device_peak_flops
from titanlab.metrics.build import build_sinks
from titanlab.run_summary import end_of_run
from titanlab import warning_filters
from titanlab.models.common.decoder import count_active_params, count_params
from titanlab.models.registry import format_families
from titanlab.optim import LRSchedulersContainer, OptimizersContainer

logger = logging.getLogger("titanlab")


class Trainer:
    """Owns the model parts, optimizer, data and checkpointer of one run; `train()` runs the loop."""

    def __init__(self, config: JobConfig) -> None:
        warning_filters.install()
        self.config = config
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        # Everything that can be checked without a process group is checked first.
        plan = preflight.check(config, world_size, local_world_size())
        self.parallel_dims, self.batch = plan.parallel_dims, plan.batch
        self.tokenizer, self.family, self.model_args = plan.tokenizer, plan.family, plan.model_args

        self.device, self.rank, _ = init_distributed(config.comm.init_timeout_seconds)
        if self.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        if self.rank == 0:
            logger.info("%s", compact_config(config, write_config_toml(config)))
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
        self._set_determinism()
        dims = self.parallel_dims
        dims.build_mesh(self.device.type)
        dp_rank, dp = dims.dp_rank(), dims.dp_degree

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

        model = components.build_meta_model(self.model_args)
        nparams, active = count_params(model), count_active_params(model)
        # An MoE token uses top_k of num_experts experts: FLOPs (and MFU) count active params.
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
        compute_dtype = param_dtype(config, self.device)
        peft_setup.adapt(model, config, compute_dtype)
        self.loss_parallel = loss_parallel_enabled(config, dims)
        self.loss_fn = build_loss_fn(
            config.compile.enable and "loss" in config.compile.components, self.loss_parallel
        )
        parallelize = functools.partial(
            parallelize_model, parallel_dims=dims, config=config, device=self.device
        )
        prepare = peft_setup.parallelize_fn(parallelize, config, dims, self.device)
        self.schedule = None
        self.pp_loss: ScaledLoss | PipelineDistillLoss | None = None
        if dims.pp_enabled:
            d = config.distill
            self.pp_loss = (
                PipelineDistillLoss(d.alpha, d.temperature)
                if d.teacher_path
                else ScaledLoss(self.loss_fn)
            )
            self.schedule, self.model_parts, self.has_first, self.has_last = pipeline_model(
                model, dims, config, self.device, prepare, self.pp_loss
            )
        else:
            prepare(model)
            to_empty_keeping_quantized(model, self.device)
            self.model_parts, self.has_first, self.has_last = [model], True, True
        self.teacher = None
        if config.distill.teacher_path and self.has_last:  # refused under CP; under PP, the
            args = teacher_args(config, self.family, self.model_args.vocab_size)  # last stage
            self.teacher = build_teacher(config, args, self.device, parallelize)
            if isinstance(self.pp_loss, PipelineDistillLoss):
                self.pp_loss.teacher = self.teacher
        elif config.distill.teacher_path:
            join_teacher_load(config)
        peft_setup.after_parallelize(self.model_parts, config, self.rank, compute_dtype)
        self.optimizer = OptimizersContainer(
            self.model_parts,
            config.optimizer,
            self.device,
            allow_fused=compute_dtype != torch.float16,
        )
        self.lr_scheduler = LRSchedulersContainer(
            self.optimizer, config.lr_scheduler, config.training.steps
        )
        self.checkpointer = Checkpointer(
            config.checkpoint,
            config.job.dump_folder,
            model_parts=self.model_parts,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.loader,
            dp_rank=dp_rank,
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
        self.step = 0 if config.checkpoint.create_seed_checkpoint else self.checkpointer.load()

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
        self.autocast = functools.partial(
            autocast_context, self.device, compute_dtype, dims.fsdp2_managed
        )
        self.scaler = build_grad_scaler(
            self.device, compute_dtype, dims.fsdp2_managed, config.training.loss_scale_init
        )
        self._loss_mesh = dims.mesh("dp_cp")
        # FSDP and DDP average gradients over these ranks; the loss is scaled up to undo it.
        self._grad_avg_ranks = self._loss_mesh.size() if self._loss_mesh is not None else 1
        # MoE: load-balance statistics over the ranks of one global microbatch (with tensor
        # parallel, each tp rank's MoE layers route their own sequence shard).
        self._moe_stats_mesh = dims.mesh("dp_cp_tp")
        moe_stats.install_stats_reduction(self.model_parts, self._moe_stats_mesh)
        self.moe_metrics: dict[str, torch.Tensor] = {}
        self.pp_microbatches = (
            config.training.local_batch_size // config.parallelism.pipeline_parallel_microbatch_size
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
        data = iter(self.loader)
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
        batches = [next(data) for _ in range(self.batch.grad_accum_steps)]
        self.metrics.data_ready()
        self.batches.record(self.step, batches)
        lr = self.lr_scheduler.get_last_lr()[0]  # the lr this step uses
        with count_step_comms(self.step):  # only when TITANLAB_COMM_COUNT is set
            loss, grad_norm = self.train_step(batches)
        if self.step == 1:
            set_train_timeout(cfg.comm.train_timeout_seconds)
        validate = (
            cfg.validation.enable
            and self.val_set is not None
            and self.step % cfg.validation.freq == 0
        )
        log = validate or self.metrics.should_log(self.step, last)
        stop = self.step < last and preemption.should_stop()
        # The host waits for the device only when it needs the values: to log, or before
        # anything that must not happen after a non-finite loss (a checkpoint, the end).
        fetch = log or stop or self.step == last or self.checkpointer.due(self.step, last)
        diverged = self.metrics.end_step(
            self.step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            extra=self.moe_metrics,
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
        """Rank 0: draw the curves (metrics.save_plot) and print the run summary."""
        self.checkpointer.wait()
        self.metrics.close()  # trackers flush and finish before the summary is printed
        logger.info("%s", end_of_run(self.config, self.metrics, self.checkpointer, self.device,
                                     first, self.step, wall_s))  # fmt: skip

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

    def train_step(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `batches` (the grad-accumulation microbatches of this rank).

        The loss is the mean over every valid token of the global batch: each token-sum is
        divided by the global token count (over dp and cp ranks) and multiplied by the number
        of ranks FSDP/DDP average gradients over, so the gradient is that of the global mean
        whatever the layout. Returns (loss, grad_norm) as 0-d float32 device tensors, equal on
        every rank; nothing here waits for the device (no host sync), except float16's loss
        scaler, which must read the overflow flag.
        """
        self.optimizer.zero_grad()
        # Pinned batches (CUDA) copy without making the host wait for the device.
        batches = [
            (i.to(self.device, non_blocking=True), t.to(self.device, non_blocking=True))
            for i, t in batches
        ]
        prepared = self.batches.prepare(self.step, batches)
        batches = [(i, t) for i, t, _ in prepared]
        # Every cp rank counts the full sequence, hence the division by cp.
        local_tokens = torch.stack([(labels != IGNORE_INDEX).sum() for _, labels in batches]).sum()
        global_tokens = global_sum(local_tokens.float(), self._loss_mesh) / self.parallel_dims.cp
        scale = self._grad_avg_ranks / global_tokens
        if self.scaler is not None:  # float16: backward on a dynamically scaled loss
            scale = self.scaler.scale(scale).reshape(())
        loss_sum = torch.zeros((), device=self.device)  # this rank's token-loss sum
        microbatches = len(batches) * (self.pp_microbatches if self.schedule is not None else 1)
        moe_stats.set_aux_grad_scale(
            self.model_parts,
            microbatches,
            self._grad_avg_ranks * (self.scaler.get_scale() if self.scaler is not None else 1.0),
        )
        with maybe_loss_parallel(self.loss_parallel), self.autocast():
            for inputs, labels, kwargs in prepared:
                loss_sum += self._forward_backward(inputs, labels, scale, kwargs)
        if self.scaler is not None:
            for opt in self.optimizer.optimizers:
                self.scaler.unscale_(opt)
        grad_norm = clip_grad_norm_(
            [p for part in self.model_parts for p in part.parameters()],
            self.config.training.max_norm,
            pp_mesh=self.parallel_dims.mesh("pp"),
        )
        total = global_sum(global_sum(loss_sum, self._loss_mesh), self.parallel_dims.mesh("pp"))
        loss = total / global_tokens
        if self.scaler is not None:
            stepped = self._scaled_step()
        else:
            self.optimizer.step()
            stepped = True
        precompute_scales(self.model_parts, self.config.float8, self.parallel_dims.fsdp_enabled)
        self.lr_scheduler.step()
        self.moe_metrics = moe_stats.end_step(
            self.model_parts, self._moe_stats_mesh, microbatches, stepped
        )
        return loss.detach(), grad_norm.detach().float()

    def _scaled_step(self) -> bool:
        """float16: step each optimizer unless a gradient overflowed, then adapt the scale.
        Returns whether the step was taken."""
        before = self.scaler.get_scale()
        for opt in self.optimizer.optimizers:
            self.scaler.step(opt)
        self.scaler.update()
        skipped = self.scaler.get_scale() < before
        if skipped and self.rank == 0:
            logger.warning(
                "step %d skipped: float16 gradients overflowed; loss scale %g → %g",
                self.step,
                before,
                self.scaler.get_scale(),
            )
        return not skipped

    def _forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, kwargs: dict
    ) -> torch.Tensor:
        """Forward and backward of one (bs, seq) batch (`kwargs`: the model's document-mask
        keywords, passed to every pipeline stage); returns its detached token-loss sum (0 on
        pipeline ranks without the last stage)."""
        context = cp_context(
            self.parallel_dims.mesh("cp"),
            inputs,
            labels,
            self.model_parts,
            self.config.parallelism.context_parallel_rotate_method,
        )
        if self.schedule is not None:
            assert self.pp_loss is not None
            self.pp_loss.scale = scale
            losses: list[torch.Tensor] = []
            args = (inputs,) if self.has_first else ()
            target = labels if self.has_last else None
            if isinstance(self.pp_loss, PipelineDistillLoss) and self.has_last:
                self.pp_loss.prepare(inputs, labels, kwargs)  # the teacher runs per microbatch
                target = self.pp_loss.rows_of(labels)
            with context:  # every stage's ranks hold their sequence shard of each microbatch
                self.schedule.step(*args, target=target, losses=losses, **kwargs)
            if not self.has_last:
                return torch.zeros((), device=self.device)
            return sum(local_value(l) for l in losses) / scale
        model = self.model_parts[0]
        with context:
            logits = model(inputs, **kwargs)
            if self.teacher is not None:
                with torch.no_grad():
                    teacher_logits = self.teacher(inputs, **kwargs)
                d = self.config.distill
                token_loss = distillation_loss_sum(
                    logits, teacher_logits, labels, alpha=d.alpha, temperature=d.temperature
                )
            else:
                token_loss = self.loss_fn(logits, labels)
            (token_loss * scale).backward()
        return local_value(token_loss)

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss over `validation.steps` batches of the held-out split."""
        loader = build_loader(
            self.val_set,
            self.config,
            self.parallel_dims.dp_rank(),
            self.parallel_dims.dp_degree,
            schedule=self.data_schedule,  # the mixture of step 1 at every validation
        )
        total = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device)
        model = self.model_parts[0]
        # Validation batches are not training microbatches: the MoE load statistics skip them.
        with maybe_loss_parallel(self.loss_parallel), moe_stats.stats_paused(model):
            for _, (inputs, labels) in zip(range(self.config.validation.steps), loader):
                inputs, labels, kwargs = self.batches.model_inputs(
                    inputs.to(self.device), labels.to(self.device)
                )
                tokens += (labels != IGNORE_INDEX).sum() / self.parallel_dims.cp
                with cp_context(
                    self.parallel_dims.mesh("cp"),
                    inputs,
                    labels,
                    self.model_parts,
                    self.config.parallelism.context_parallel_rotate_method,
                ):
                    total += local_value(self.loss_fn(model(inputs, **kwargs), labels))
        return (global_sum(total, self._loss_mesh) / global_sum(tokens, self._loss_mesh)).item()

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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(format_help() + "\n\n" + format_families())
        return 0
    logging.basicConfig(
        level=logging.INFO,
        format="[titanlab] %(asctime)s %(levelname)s %(message)s",
        stream=sys.stdout,
        force=True,
    )
    trainer, clean = None, False
    try:
        config = build_config(argv)
        trainer = Trainer(config)
        trainer.train()
        trainer.close()
        clean = True
        return 0
    except Preempted:  # every rank stops after the same step
        assert trainer is not None  # only Trainer.train raises Preempted
        trainer.close()
        clean = True
        return REQUEUE_EXIT_CODE
    except ConfigError as e:
        return fail(f"titanlab: error: {e}", CONFIG_ERROR_EXIT_CODE)
    except TrainingDiverged as e:
        return fail(f"titanlab: error: {e}", DIVERGED_EXIT_CODE)
    except OutOfMemory as e:
        return fail(str(e), OOM_EXIT_CODE)
    except Exception as e:
        if trainer is None or not is_collective_timeout(e):
            raise
        last = trainer.checkpointer.last_complete()
        timeout_s = trainer.config.comm.train_timeout_seconds
        return fail(timeout_line(e, trainer.rank, trainer.step, timeout_s, last), HANG_EXIT_CODE)
    finally:
        destroy_distributed(barrier=clean)


if __name__ == "__main__":
    exit_process(main())
