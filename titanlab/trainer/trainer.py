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
import logging
import os
import socket
from typing import Any

import torch

from titanlab.config.performance import compiles_loss, fused_loss, loss_description
from titanlab.checkpoint import Checkpointer
from titanlab.components import builders as components
from titanlab.components.loss import ScaledLoss, build_loss_fn
from titanlab.components.optim import LRSchedulersContainer, OptimizersContainer
from titanlab.config.dump import compact_config, write_config_toml
from titanlab.config.job_config import JobConfig
from titanlab.data.batches import BatchPreparer
from titanlab.data.build import build_data, build_loader
from titanlab.distributed import moe_stats
from titanlab.distributed.init import hold_group_threads, init_distributed, init_fake_world
from titanlab.distributed.parallelize import loss_parallel_enabled, param_dtype, parallelize_model
from titanlab.distributed.parallelize import tp_grid_loss
from titanlab.distributed.pipeline import pipeline_model
from titanlab.metrics import MetricsLogger, device_peak_flops
from titanlab.metrics.build import build_sinks
from titanlab.models.common.decoder import Decoder
from titanlab.models.common.counting import count_active_params, describe_params
from titanlab.models.common.mtp import trains_mtp
from titanlab.observability import warning_filters
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
from titanlab.precision.float8_experts import apply_float8_experts
from titanlab.trainer import dry_run, peft_steps, rl_steps
from titanlab.trainer.host_allocator import fix_malloc_thresholds
from titanlab.resilience.replica_group import ReplicaGroup, data_rank, group_dump_folder
from titanlab.trainer.loop import TrainLoop

logger = logging.getLogger("titanlab")


class Trainer(TrainLoop):
    """Owns the model parts, optimizer, data and checkpointer of one run; `train()` runs the
    loop. Raises ConfigError (one line) before any process group exists when the config cannot
    run (`titanlab.planning.preflight`)."""

    loader: Any  # the token-window loader, or a reinforcement-learning run's prompt stream

    def __init__(self, config: JobConfig) -> None:
        warning_filters.install()
        self.config = config
        ft = config.fault_tolerance
        if ft.enable:  # each replica group writes its own config, metrics and checkpoints
            config.job.dump_folder = group_dump_folder(config.job.dump_folder, ft.replica_id)
        self.ft: ReplicaGroup | None = None
        # A dry run (comm.mode "fake_backend"): one process plays rank 0 of the whole world on
        # fake process groups, the model on the meta device, planned for comm.dry_run_device.
        self.dry_run = dry_run.target(config)
        self.float8 = dry_run.float8(config, self.dry_run)  # the target's float8, checked first
        world_size = dry_run.world_size(config)
        # Everything that can be checked without a process group is checked first.
        plan = preflight.check(config, world_size, local_world_size(), self.dry_run)
        self.parallel_dims, self.batch = plan.parallel_dims, plan.batch
        self.tokenizer, self.family, self.model_args = plan.tokenizer, plan.family, plan.model_args
        self.memory = plan.memory
        if self.dry_run is not None:
            self.device, self.rank, _ = init_fake_world(world_size)
        elif config.comm.mode == "local_tensor":  # every rank in this process (local_tensor.py)
            self.device, self.rank, _ = init_fake_world(world_size, "cpu")
        else:
            self.device, self.rank, _ = init_distributed(config.comm.init_timeout_seconds)
        if self.device.type == "cpu" and config.training.fixed_malloc_thresholds:
            fix_malloc_thresholds()  # before the model's memory is first allocated
        self._log_start(world_size)
        self._set_determinism()
        self.parallel_dims.build_mesh("cpu" if self.device.type == "meta" else self.device.type)

        if self.dry_run is None:  # a dry run reads no data (the pre-flight checked the files)
            self._build_data()
        model, flops_per_token = self._build_model()
        self.flops_per_token = flops_per_token  # training FLOPs per token (MFU, the ledger)
        compute_dtype = param_dtype(config, self.device)
        peft_steps.adapt(model, config, compute_dtype)
        if fused_loss(config):
            use_fused_loss(model, config.loss.chunk_size, compiles_loss(config))
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
        if self.dry_run is not None:  # nothing to load, train or log: `dry_run.report` follows
            return
        self._build_checkpointer(world_size)
        self.step = 0 if config.checkpoint.create_seed_checkpoint else self.checkpointer.load()
        self._build_metrics(world_size, flops_per_token)
        self.init_step_state(compute_dtype)
        if ft.enable:
            hold_group_threads()  # the managed group's threads must not meet finalization
            self.ft = ReplicaGroup(ft, self.checkpointer, self.lr_scheduler, self.device,
                                   lambda: self.step, self._recovered)  # fmt: skip
            # MoE's load statistics span the groups, as HSDP's span dp_replicate
            moe_stats.install_stats_reduction(self.model_parts, self._moe_stats_mesh,
                                              across=self.ft.step_sum)  # fmt: skip
        self.rl = rl_steps.recipe(self)

    # --- the recipe's parts, in order ---------------------------------------------------
    def _log_start(self, world_size: int) -> None:
        if self.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        target = self.dry_run
        if self.rank == 0:  # a dry run writes nothing
            full = "not written in a dry run" if target else write_config_toml(self.config)
            logger.info("%s", compact_config(self.config, full))
        per_node = min(world_size, target.devices_per_node) if target else local_world_size()
        logger.info(
            "distributed: world size %d = %d node(s) × %d rank(s), backend %s, rank 0 on %s, "
            "restart %s",
            world_size,
            world_size // per_node,
            per_node,
            torch.distributed.get_backend() if torch.distributed.is_initialized() else "none",
            socket.gethostname(),
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        )

    def _build_data(self) -> None:
        """The train and held-out splits, the batch preparer and the train loader."""
        config, dims = self.config, self.parallel_dims
        dp_rank, dp = dims.dp_rank(), dims.dp_degree
        samples = self.batch.global_batch_size
        ft = config.fault_tolerance
        if ft.enable:  # the groups read the data as HSDP's replicas would
            dp_rank, dp = data_rank(ft, dp_rank, dp)
            samples *= ft.replica_count
        if config.rl.algorithm != "none":  # prompts instead of token windows
            self.val_set = self.data_schedule = None
            self.loader = rl_steps.data_stream(self)
            return
        data = build_data(config, self.tokenizer)
        train_set, self.val_set = data.train, data.val
        self.batches = BatchPreparer(config, data.masking, self.rank, dp_rank)
        self.data_schedule = data.schedule
        self.loader = build_loader(train_set, config, dp_rank, dp, samples, data.schedule)
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
        flops_per_token = self.family.flops_per_token(
            self.model_args,
            config.training.seq_len,
            count_active_params(model, exclude_embedding=True),
        )
        logger.info(
            "model: %s %s, %s, %.3e training FLOPs/token; layout: %s",
            self.family.name,
            config.model.flavor,
            describe_params(model),
            flops_per_token,
            dims,
        )
        apply_float8(model, self.float8, self.device, dims.fsdp_enabled)
        apply_float8_experts(model, self.float8, self.device)
        return model, flops_per_token

    def _parallelize(self, model: Decoder):
        """Apply the layout: one model part, or this rank's pipeline stages and their schedule.
        Returns the parallelize function (the teacher gets the same one)."""
        config, dims = self.config, self.parallel_dims
        self.loss_parallel = loss_parallel_enabled(config, dims)
        self.loss_fn = tp_grid_loss(build_loss_fn(compiles_loss(config), self.loss_parallel), dims)
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
            if fused or trains_mtp(self.model_args):  # the last stage's head or MTP depths
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
        elif config.distill.teacher_path and self.dry_run is None:
            join_teacher_load(config)

    def _build_checkpointer(self, world_size: int) -> None:
        """The checkpointer, then the initial weights: drawn from the seed, or, when a checkpoint
        that holds them all loads next (`Checkpointer.load`), left to it."""
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
            self.model_parts,
            self.model_args,
            self.device,
            config.debug.seed,
            world_size,
            weights_loaded=self.checkpointer.loads_every_weight(),
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

    def _recovered(self, step: int) -> None:
        """Fault tolerance: this group took a live peer's state of `step`."""
        self.step = step

    def close(self) -> None:
        if self.ft is not None:
            self.ft.shutdown()
        self.checkpointer.close()
        self.metrics.close()
