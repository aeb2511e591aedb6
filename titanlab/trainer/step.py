"""The training step: forward and backward over the grad-accumulation microbatches of one
global batch, gradient clipping, the optimizer step; and validation.

`TrainStep` is the half of `titanlab.trainer.Trainer` that runs a step; the Trainer builds what
it uses (model parts, pipeline schedule, optimizer, LR schedule, loss, autocast, grad scaler,
meshes) and calls `train_step` once per step. The loss is the mean token cross-entropy (or the
distillation loss) over every valid token of the global batch, whatever the layout.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from titanlab.config.performance import fused_loss
from titanlab.components.loss import ScaledLoss, local_value, maybe_loss_parallel
from titanlab.components.muon import record_times
from titanlab.components.optim import LRSchedulersContainer, OptimizersContainer
from titanlab.config.job_config import JobConfig
from titanlab.data.batches import BatchPreparer
from titanlab.data.build import build_loader
from titanlab.data.labels import IGNORE_INDEX
from titanlab.distributed import moe_stats, qk_clip
from titanlab.distributed.context_parallel.torch_sdpa import cp_context
from titanlab.distributed.context_parallel.documents import cp_attention, needs_own_cp, shard_batch
from titanlab.models.common.token_mixer import own_cp_layers
from titanlab.distributed.parallel_dims import ParallelDims
from titanlab.distributed.utils import clip_grad_norm_, global_sum
from titanlab.models.common.mtp import mtp_targets, trains_mtp
from titanlab.posttrain.distill import PipelineDistillLoss, distillation_loss_sum
from titanlab.components.fused_head import fused_distillation, fused_targets, teacher_hidden
from titanlab.components.fused_pipeline import LABELS
from titanlab.precision.float8 import precompute_scales
from titanlab.resilience.nonfinite import NonFiniteSteps
from titanlab.resilience.replica_group import data_rank
from titanlab.precision.mixed import autocast_context, build_grad_scaler

logger = logging.getLogger("titanlab")


class TrainStep:
    """`train_step` and `validate` over the attributes the Trainer sets (`config`,
    `parallel_dims`, `device`, `rank`, `step`, `model_parts`, `schedule`, `pp_loss`,
    `model_args`, `has_first`, `has_last`, `teacher`, `loss_fn`, `loss_parallel`, `optimizer`,
    `lr_scheduler`, `batches`, `val_set`, `data_schedule`, `dry_run`); `init_step_state` sets
    the rest."""

    config: JobConfig
    parallel_dims: ParallelDims
    device: torch.device
    rank: int
    step: int
    model_parts: list[torch.nn.Module]
    model_args: Any
    schedule: Any  # a torch.distributed.pipelining schedule, None without PP
    pp_loss: ScaledLoss | PipelineDistillLoss | None
    has_first: bool
    has_last: bool
    teacher: torch.nn.Module | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    loss_parallel: bool
    optimizer: OptimizersContainer
    lr_scheduler: LRSchedulersContainer
    batches: BatchPreparer
    val_set: Any
    data_schedule: Any
    ft: Any  # a `titanlab.resilience.replica_group.ReplicaGroup` under fault tolerance, or None
    dry_run: Any  # the dry run's target (comm.mode fake_backend: fake tensors), or None

    def init_step_state(self, compute_dtype: torch.dtype) -> None:
        """Autocast, the float16 grad scaler, the loss and MoE-statistics meshes."""
        dims, config = self.parallel_dims, self.config
        self.autocast = functools.partial(
            autocast_context, self.device, compute_dtype, dims.fsdp2_managed
        )
        self.scaler = build_grad_scaler(
            self.device, compute_dtype, dims.fsdp2_managed, config.training.loss_scale_init
        )
        # training.skip_nonfinite_steps (a dry run's fake tensors hold no values to check)
        tolerated = -1 if self.dry_run is not None else config.training.skip_nonfinite_steps
        self.nonfinite = NonFiniteSteps(tolerated, scaled=self.scaler is not None)
        self._loss_mesh = dims.mesh("dp_cp")
        # FSDP and DDP average gradients over these ranks; the loss is scaled up to undo it.
        self._grad_avg_ranks = self._loss_mesh.size() if self._loss_mesh is not None else 1
        # MoE: load-balance statistics over the ranks of one global microbatch (with tensor
        # parallel, each tp rank's MoE layers route their own sequence shard).
        self._moe_stats_mesh = dims.mesh("dp_cp_tp")
        moe_stats.install_stats_reduction(self.model_parts, self._moe_stats_mesh)
        # multi-token prediction depths train (their loss computed and logged as `mtp_loss`)
        self.trains_mtp = trains_mtp(getattr(self.model_parts[0], "args", None))
        self.moe_metrics: dict[str, torch.Tensor] = {}
        # MuonClip's QK-clip: every attention records its heads' largest logit of the step
        self.qk_clip_tau = config.optimizer.qk_clip_threshold
        if self.qk_clip_tau > 0:
            qk_clip.install(self.model_parts)
        self.pp_microbatches = (
            config.training.local_batch_size // config.parallelism.pipeline_parallel_microbatch_size
        )

    def train_step(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `batches` (the grad-accumulation microbatches of this rank).

        The loss is the mean over every valid token of the global batch: each token-sum is
        divided by the global token count (over dp and cp ranks) and multiplied by the number
        of ranks FSDP/DDP average gradients over, so the gradient is that of the global mean
        whatever the layout. Returns (loss, grad_norm) as 0-d float32 device tensors, equal on
        every rank; nothing here waits for the device (no host sync), except float16's loss
        scaler, which must read the overflow flag, and `training.skip_nonfinite_steps` >= 0,
        which reads the loss and the norm before the update (`titanlab.resilience.nonfinite`:
        a non-finite step is not applied; raises TrainingDiverged after too many in a row).
        """
        self.optimizer.zero_grad()
        if self.qk_clip_tau > 0:
            qk_clip.reset(self.model_parts)
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
        if self.ft is not None:  # the tokens of every replica group in the step's quorum
            global_tokens = self.ft.step_sum(global_tokens)
        scale = self._grad_avg_ranks / global_tokens
        if self.scaler is not None:  # float16: backward on a dynamically scaled loss
            scale = self.scaler.scale(scale).reshape(())
        loss_sum = torch.zeros((), device=self.device)  # this rank's token-loss sum
        self.mtp_loss_sum = torch.zeros((), device=self.device)  # its MTP depths' (`_mtp_loss`)
        microbatches = len(batches) * (self.pp_microbatches if self.schedule is not None else 1)
        moe_stats.set_aux_grad_scale(
            self.model_parts,
            microbatches,
            self._grad_avg_ranks * (self.scaler.get_scale() if self.scaler is not None else 1.0),
        )
        with maybe_loss_parallel(self.loss_parallel):
            for i, (inputs, labels, kwargs) in enumerate(prepared):
                if self.schedule is None and len(prepared) > 1:
                    self._set_microbatch_sync(last=i == len(prepared) - 1)
                loss_sum += self._forward_backward(inputs, labels, scale, kwargs)
        if self.scaler is not None:
            for opt in self.optimizer.optimizers:
                self.scaler.unscale_(opt)
        params = [p for part in self.model_parts for p in part.parameters()]
        total = global_sum(global_sum(loss_sum, self._loss_mesh), self.parallel_dims.mesh("pp"))
        if self.ft is not None and self.ft.diloco is None:  # the groups' shares, summed
            total = self.ft.sum_gradients(params, total)
        grad_norm = clip_grad_norm_(
            params, self.config.training.max_norm, pp_mesh=self.parallel_dims.mesh("pp")
        )
        loss = total / global_tokens
        # Fault tolerance: a step some replica group failed in is not taken (and runs again).
        self.committed = self.ft is None or self.ft.commit()
        if not self.committed:
            stepped = False
        elif self._skip_nonfinite(loss, grad_norm):
            stepped = False
            self.optimizer.zero_grad()
            if self.scaler is not None:  # unscale_ recorded the overflow flags: adapt the scale
                self.scaler.update()
        elif self.scaler is not None:
            stepped = self._scaled_step()
        else:
            start = time.perf_counter()
            self.optimizer.step()
            record_times(self.rank, self.step, self.optimizer.optimizers,
                         time.perf_counter() - start)  # fmt: skip
            stepped = True
        if self.committed:
            precompute_scales(self.model_parts, self.config.float8, self.parallel_dims.fsdp_enabled)
            self.lr_scheduler.step()
        self.moe_metrics = moe_stats.end_step(
            self.model_parts, self._moe_stats_mesh, microbatches, stepped,
            across=self.ft.step_sum if self.ft is not None else None,
        )  # fmt: skip
        if self.trains_mtp:
            # the depths' summed cross-entropy over the main loss's token count (the last
            # pipeline stage's ranks hold it; the others add 0)
            mtp = global_sum(self.mtp_loss_sum, self._loss_mesh)
            mtp = global_sum(mtp, self.parallel_dims.mesh("pp")) / global_tokens
            self.moe_metrics["mtp_loss"] = mtp.detach()
        if self.qk_clip_tau > 0 and stepped:
            n_layers = self.model_args.n_layers
            self.moe_metrics.update(qk_clip.clip(self.model_parts, self.qk_clip_tau, n_layers))
        ns = sum(getattr(opt, "ns_flops", 0) for opt in self.optimizer.optimizers)
        if ns:  # Muon: this rank's Newton-Schulz work of the step
            self.moe_metrics["muon/ns_gflop"] = torch.tensor(ns / 1e9)
        return loss.detach(), grad_norm.detach().float()

    def _set_microbatch_sync(self, last: bool) -> None:
        """Gradient accumulation by ZeRO stage (`parallelism.zero_stage`), set before each
        microbatch (the pipeline schedules do the same for their own microbatches): stages 1
        and 2 keep the parameters gathered until the last microbatch's backward (one
        all-gather per step); stage 1 also accumulates whole gradients and reduce-scatters them
        once, and stage 0 (DDP) all-reduces once, after the last microbatch. Stage 3 gathers
        and reduce-scatters per microbatch (FSDP2's default)."""
        stage = self.config.parallelism.zero_stage_in_force
        for part in self.model_parts:
            if not isinstance(part, FSDPModule):
                continue
            if stage in (1, 2):
                part.set_reshard_after_backward(last)
            if stage in (0, 1):
                part.set_requires_gradient_sync(last)

    def _skip_nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """`training.skip_nonfinite_steps`: whether this step's global loss or gradient norm is
        non-finite and the update must not be applied (the same answer on every rank: both
        values are already reduced over every rank). Reads them on the host (one transfer)
        when the check is on; False at once when it is off."""
        if not self.nonfinite.enabled:
            return False
        return self.nonfinite.skip(self.step, *self.nonfinite.read(loss, grad_norm), self.rank)

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
        inputs, labels, kwargs, context = self._cp(inputs, labels, kwargs)
        if self.schedule is not None:
            assert self.pp_loss is not None
            self.pp_loss.scale = scale
            losses: list[torch.Tensor] = []
            args = (inputs,) if self.has_first else ()
            target = labels if self.has_last else None
            if isinstance(self.pp_loss, PipelineDistillLoss) and self.has_last:
                self.pp_loss.prepare(inputs, labels, kwargs)  # the teacher runs per microbatch
                target = self.pp_loss.rows_of(labels)
            if fused_loss(self.config) or self.trains_mtp:
                # every stage's `take_labels` hands them to the fused head and MTP depths
                kwargs = {**kwargs, LABELS: labels}
            # every stage's ranks hold their sequence shard of each microbatch; the schedule
            # runs forward and backward together, so both run under autocast
            with context, self.autocast(), self._mtp_loss(None, scale):
                self.schedule.step(*args, target=target, losses=losses, **kwargs)
            if not self.has_last:
                return torch.zeros((), device=self.device)
            return sum(local_value(l) for l in losses) / scale
        # Autocast covers the forward and the loss only (PyTorch's advice): backward runs in the
        # dtypes forward chose, without autocast's dispatch on every backward op (a profile of
        # one bf16 CPU step showed 62 extra casts when backward ran inside it).
        with context:
            with self.autocast(), self._mtp_loss(labels, scale):
                token_loss = self._loss(inputs, labels, kwargs)
            (token_loss * scale).backward()
        return local_value(token_loss)

    def _cp(
        self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor, dict, Any]:
        """Under context parallel: (inputs, labels, kwargs) of this cp rank and the context the
        model runs in. Causal ring batches go through PyTorch's `context_parallel` (it shards
        them in place inside its context); document-masked batches, models with sliding
        windows or sinks, and Ulysses are sharded here and run titanlab's CP attention
        (`titanlab.distributed.context_parallel.documents`). Without
        cp: the batch as given and a no-op context."""
        mesh, par = self.parallel_dims.mesh("cp"), self.config.parallelism
        local = own_cp_layers(self.model_args)
        if mesh is None or not needs_own_cp(par.context_parallel_mode, kwargs, local):
            rotate = par.context_parallel_rotate_method
            return (
                inputs,
                labels,
                kwargs,
                cp_context(mesh, inputs, labels, self.model_parts, rotate),
            )
        documents = kwargs.get("segments") is not None
        inputs, labels, kwargs = shard_batch(
            inputs, labels, kwargs, mesh.size(), mesh.get_local_rank(),
            par.context_parallel_mode, par.context_parallel_load_balancer,
        )  # fmt: skip
        context = cp_attention(
            mesh.get_group(), par.context_parallel_mode, par.context_parallel_rotate_method,
            documents,
        )  # fmt: skip
        return inputs, labels, kwargs, context

    def _mtp_loss(self, labels: torch.Tensor | None, scale: torch.Tensor) -> Any:
        """Multi-token prediction (DeepSeek-V3; `titanlab.models.common.mtp`): within, the
        forward of the part holding the depths (the model, or the last pipeline stage, whose
        labels come per microbatch: `labels` None) also computes their loss, weighted λ / D
        times the main loss's scale in backward, and adds its token sum to
        `self.mtp_loss_sum`; a no-op without trained depths or on ranks without them."""
        parts: list[Any] = [p for p in self.model_parts if getattr(p, "mtp", None) is not None]
        if not parts or not self.trains_mtp:
            return contextlib.nullcontext()
        model, args = parts[0], parts[0].args

        @contextlib.contextmanager
        def computing() -> Iterator[None]:
            with mtp_targets(model, labels, scale * (args.mtp_loss_weight / args.mtp_layers)):
                yield
            if model.last_mtp_loss is not None:
                self.mtp_loss_sum = self.mtp_loss_sum + local_value(model.last_mtp_loss)

        return computing()

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """The token-loss sum of one batch (0-dim fp32; a DTensor under loss parallel): the
        model's forward, then the cross-entropy or the distillation loss, or the fused head's."""
        model = self.model_parts[0]
        d = self.config.distill
        if fused_loss(self.config):  # the model's forward ends in the loss
            if self.teacher is not None:
                with torch.no_grad():
                    teacher = teacher_hidden(self.teacher, inputs, **kwargs)
                loss_in = fused_distillation(model, labels, teacher, d.alpha, d.temperature)
            else:
                loss_in = fused_targets(model, labels)
            with loss_in:
                return model(inputs, **kwargs)
        logits = model(inputs, **kwargs)
        if self.teacher is None:
            return self.loss_fn(logits, labels)
        with torch.no_grad():
            teacher_logits = self.teacher(inputs, **kwargs)
        return distillation_loss_sum(
            logits, teacher_logits, labels, alpha=d.alpha, temperature=d.temperature
        )

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss over `validation.steps` batches of the held-out split (under fault
        tolerance, of every replica group's share: `ReplicaGroup.sum_over_groups`)."""
        dp_rank, dp = self.parallel_dims.dp_rank(), self.parallel_dims.dp_degree
        if self.ft is not None:  # the groups read the held-out split as HSDP's replicas would
            dp_rank, dp = data_rank(self.config.fault_tolerance, dp_rank, dp)
        loader = build_loader(
            self.val_set,
            self.config,
            dp_rank,
            dp,
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
                inputs, labels, kwargs, context = self._cp(inputs, labels, kwargs)
                with context:
                    if fused_loss(self.config):
                        with fused_targets(model, labels):
                            total += local_value(model(inputs, **kwargs))
                    else:
                        total += local_value(self.loss_fn(model(inputs, **kwargs), labels))
        total, tokens = global_sum(total, self._loss_mesh), global_sum(tokens, self._loss_mesh)
        if self.ft is not None:
            total, tokens = self.ft.sum_over_groups(total, tokens)
        return (total / tokens).item()
