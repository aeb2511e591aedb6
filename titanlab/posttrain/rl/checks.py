"""Pre-flight checks of a reinforcement-learning config that need the resolved batch layout."""

from __future__ import annotations

from typing import Any

from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.data.digit_tasks import DigitTask
from titanlab.posttrain.rl.pairs import read_pairs
from titanlab.posttrain.rl.rewards import RewardSet


def check_rl(config: JobConfig, batch: Any, tokenizer: Any) -> None:
    """One batch per step (no gradient accumulation), prompt + completion within
    `training.seq_len`, every reward function importable, DPO's pairs readable. Raises
    ConfigError (one line)."""
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
    if rl.data_path:  # DPO pairs
        longest = max(
            len(p) + max(len(c), len(r)) for p, c, r in read_pairs(rl.data_path, tokenizer)
        )
        if longest > config.training.seq_len:
            raise ConfigError(
                f"rl.data_path={rl.data_path!r} has a pair of {longest} tokens (prompt + the "
                f"longer completion) over training.seq_len={config.training.seq_len}; raise "
                f"seq_len to {longest} or shorten the pairs"
            )
        return
    task = DigitTask(rl.task, rl.task_digits)
    need = task.prompt_len + (rl.max_new_tokens or task.answer_len)
    if need > config.training.seq_len:
        raise ConfigError(
            f"training.seq_len={config.training.seq_len} is shorter than a prompt "
            f"({task.prompt_len} tokens) + rl.max_new_tokens "
            f"({rl.max_new_tokens or task.answer_len}); use seq_len >= {need}"
        )
    if rl.algorithm != "dpo":
        RewardSet(rl.rewards, rl.reward_weights)
