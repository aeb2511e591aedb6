"""The Trainer's reinforcement-learning parts (`[rl]`): the prompt stream in place of the data
loader, the frozen reference, the recipe in place of `train_step`, and its step with the
held-out evaluation. `titanlab.posttrain.rl` holds the algorithm itself."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from titanlab.config.job_config import JobConfig
from titanlab.data.digit_tasks import DigitTask
from titanlab.posttrain.rl.grpo import GRPO
from titanlab.posttrain.rl.prompts import PromptStream
from titanlab.posttrain.rl.reference import build_reference

logger = logging.getLogger("titanlab")


def prompt_stream(config: JobConfig, dp_rank: int, batch: Any) -> PromptStream:
    """This rank's prompts, checkpointed as the data loader's state."""
    rl = config.rl
    logger.info(
        "data: rl task %s of %d digits, %d completions per rank (%d per prompt); batch: %s",
        rl.task, rl.task_digits, config.training.local_batch_size, rl.group_size, batch,
    )  # fmt: skip
    return PromptStream(DigitTask(rl.task, rl.task_digits), config.debug.seed, dp_rank)


def reference(trainer: Any, parallelize) -> nn.Module | None:
    """The frozen reference policy, only when the KL term is on (`rl.beta > 0`)."""
    config = trainer.config
    if config.rl.algorithm == "none" or config.rl.beta == 0:
        return None
    return build_reference(
        config, trainer.model_args, trainer.device, parallelize, trainer.parallel_dims.world_size
    )


def recipe(trainer: Any) -> GRPO | None:
    """The recipe that replaces `train_step` (None: pretraining or SFT)."""
    dims = trainer.parallel_dims
    if trainer.config.rl.algorithm != "grpo":
        return None
    return GRPO(
        trainer.config, trainer.model_parts[0], trainer.reference, trainer.optimizer,
        trainer.lr_scheduler, device=trainer.device, dp_mesh=trainer._loss_mesh,
        dp_rank=dims.dp_rank(), dp_degree=dims.dp_degree, tp_degree=dims.tp,
        grad_avg_ranks=trainer._grad_avg_ranks, moe_mesh=trainer._moe_stats_mesh,
        autocast=trainer.autocast, stream=trainer.loader,
    )  # fmt: skip


def step(
    rl: GRPO, config: JobConfig, step: int, last: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], bool]:
    """One RL step, then the greedy held-out evaluation when due (every `rl.eval_freq` steps
    and at the last). Returns (loss, grad_norm, metrics, whether it evaluated)."""
    loss, grad_norm, extra = rl.step(step)
    freq = config.rl.eval_freq
    evaluate = bool(freq) and (step % freq == 0 or step == last)
    if evaluate:
        extra.update({k: torch.tensor(v) for k, v in rl.evaluate().items()})
    return loss, grad_norm, extra, evaluate
