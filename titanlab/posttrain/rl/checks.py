"""Pre-flight checks of a reinforcement-learning config that need the resolved batch layout."""

from __future__ import annotations

from typing import Any

from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.data.digit_tasks import DigitTask
from titanlab.posttrain.rl.rewards import RewardSet


def check_rl(config: JobConfig, batch: Any) -> None:
    """One rollout batch per step (no gradient accumulation), prompt + completion within
    `training.seq_len`, and every reward function importable. Raises ConfigError (one line)."""
    rl = config.rl
    if rl.algorithm == "none":
        return
    if batch.grad_accum_steps != 1:
        per_step = batch.local_batch_size * batch.dp_degree
        raise ConfigError(
            f"rl.algorithm={rl.algorithm} takes one rollout batch per step: "
            f"training.global_batch_size={batch.global_batch_size} must be local_batch_size × "
            f"dp = {per_step} (or -1)"
        )
    task = DigitTask(rl.task, rl.task_digits)
    need = task.prompt_len + (rl.max_new_tokens or task.answer_len)
    if need > config.training.seq_len:
        raise ConfigError(
            f"training.seq_len={config.training.seq_len} is shorter than a prompt "
            f"({task.prompt_len} tokens) + rl.max_new_tokens "
            f"({rl.max_new_tokens or task.answer_len}); use seq_len >= {need}"
        )
    RewardSet(rl.rewards, rl.reward_weights)
