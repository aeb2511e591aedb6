"""The Trainer's reinforcement-learning and preference parts (`[rl]`): the prompt or pair
stream in place of the data loader, PPO's value head, the frozen reference, the recipe in place
of `train_step`, and its step with the held-out evaluation. `titanlab.posttrain.rl` holds the algorithms."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from titanlab.config.job_config import JobConfig
from titanlab.data.digit_tasks import DigitTask
from titanlab.posttrain.rl.dpo import DPO
from titanlab.posttrain.rl.grpo import GRPO
from titanlab.posttrain.rl.pairs import PairStream, read_pairs
from titanlab.posttrain.rl.ppo import PPO
from titanlab.posttrain.rl.prompts import PromptStream, read_prompts
from titanlab.posttrain.rl.reference import AdaptersOff, build_reference
from titanlab.posttrain.rl.value_head import add_value_head, zero_value_head

logger = logging.getLogger("titanlab")


def data_stream(trainer: Any) -> PromptStream | PairStream:
    """This rank's prompts (GRPO, PPO) or preference pairs (DPO), checkpointed as the data
    loader's state with the identity of the reference policy, which is rebuilt on resume."""
    stream = _stream(trainer)
    config = trainer.config
    stream.reference = config.checkpoint.initial_load_path or f"seed {config.debug.seed}"
    return stream


def _stream(trainer: Any) -> PromptStream | PairStream:
    config, dims = trainer.config, trainer.parallel_dims
    rl, seed = config.rl, config.debug.seed
    task = DigitTask(rl.task, rl.task_digits)
    what = f"rl task {rl.task} of {rl.task_digits} digits"
    if rl.algorithm == "dpo":
        source: DigitTask | list = task
        if rl.data_path:
            source = read_pairs(rl.data_path, trainer.tokenizer)
            what = f"{len(source)} preference pairs from {rl.data_path}"
        logger.info("data: %s, %d pairs per rank; batch: %s", what,
                    config.training.local_batch_size, trainer.batch)  # fmt: skip
        return PairStream(source, seed, dims.dp_rank(), dims.dp_degree)
    stream_args: dict[str, Any] = {"format_pattern": rl.format_pattern}
    prompts: DigitTask | list = task
    if rl.data_path:
        prompts, stop_ids = read_prompts(rl.data_path, trainer.tokenizer)
        stream_args.update(tokenizer=trainer.tokenizer, stop_ids=stop_ids)
        what = f"{len(prompts)} prompts from {rl.data_path}"
    logger.info(
        "data: %s, %d completions per rank (%d per prompt); batch: %s",
        what, config.training.local_batch_size, rl.group_size, trainer.batch,
    )  # fmt: skip
    return PromptStream(prompts, seed, dims.dp_rank(), dims.dp_degree, **stream_args)


def adapt(model: nn.Module, config: JobConfig) -> None:
    """PPO: the value head on the policy's trunk, on the meta model (parallelized with it)."""
    if config.rl.algorithm == "ppo":
        add_value_head(model)


def init_weights(model_parts: list[nn.Module], config: JobConfig) -> None:
    """After the model's initialization: PPO's value head starts at 0."""
    if config.rl.algorithm == "ppo":
        zero_value_head(model_parts)


def reference(trainer: Any, parallelize) -> nn.Module | None:
    """The frozen reference policy: DPO's, and GRPO's when its KL term is on (`rl.beta > 0`);
    with LoRA the policy itself with its adapters off."""
    config = trainer.config
    if config.rl.algorithm == "none" or config.rl.beta == 0:
        return None
    if config.peft.method == "lora":
        logger.info("rl: reference policy = the base model (the policy with its adapters off)")
        return AdaptersOff(trainer.model_parts[0])
    return build_reference(
        config, trainer.model_args, trainer.device, parallelize, trainer.parallel_dims.world_size
    )


def recipe(trainer: Any) -> GRPO | PPO | DPO | None:
    """The recipe that replaces `train_step` (None: pretraining or SFT)."""
    dims, algorithm = trainer.parallel_dims, trainer.config.rl.algorithm
    if algorithm == "none":
        return None
    cls = {"grpo": GRPO, "ppo": PPO, "dpo": DPO}[algorithm]
    return cls(
        trainer.config, trainer.model_parts[0], trainer.reference, trainer.optimizer,
        trainer.lr_scheduler, device=trainer.device, dp_mesh=trainer._loss_mesh,
        dp_rank=dims.dp_rank(), dp_degree=dims.dp_degree, tp_degree=dims.tp,
        grad_avg_ranks=trainer._grad_avg_ranks, moe_mesh=trainer._moe_stats_mesh,
        autocast=trainer.autocast, stream=trainer.loader,
    )  # fmt: skip


def step(
    rl: GRPO | PPO | DPO, config: JobConfig, step: int, last: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], bool]:
    """One step, then the held-out evaluation when due (every `rl.eval_freq` steps and at the
    last). Returns (loss, grad_norm, metrics, whether it evaluated)."""
    loss, grad_norm, extra = rl.step(step)
    freq = config.rl.eval_freq
    evaluate = bool(freq) and (step % freq == 0 or step == last)
    if evaluate:
        extra.update({k: torch.tensor(v) for k, v in rl.evaluate().items()})
    return loss, grad_norm, extra, evaluate
