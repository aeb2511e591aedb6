"""Pre-flight checks of a reinforcement-learning config that need the resolved batch layout."""

from __future__ import annotations

from typing import Any

from titanlab.config.job_config import ConfigError, JobConfig
from titanlab.data.digit_tasks import DigitTask
from titanlab.posttrain.rl.pairs import read_pairs
from titanlab.posttrain.rl.prompts import read_prompts
from titanlab.posttrain.rl.rewards import RewardSet


def check_rl(config: JobConfig, batch: Any, tokenizer: Any) -> None:
    """One batch per step (no gradient accumulation), prompt + completion within
    `training.seq_len`, every reward function importable, the JSONL prompts or pairs readable. Raises
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
    if rl.data_path and rl.algorithm == "dpo":
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
    if rl.data_path:
        examples, _ = read_prompts(rl.data_path, tokenizer)
        prompt_len, new_tokens = max(len(e.ids) for e in examples), rl.max_new_tokens
        what = f"the longest prompt of rl.data_path ({prompt_len} tokens)"
    else:
        task = DigitTask(rl.task, rl.task_digits)
        prompt_len, new_tokens = task.prompt_len, rl.max_new_tokens or task.answer_len
        what = f"a prompt ({prompt_len} tokens)"
    if prompt_len + new_tokens > config.training.seq_len:
        raise ConfigError(
            f"training.seq_len={config.training.seq_len} is shorter than {what} + "
            f"rl.max_new_tokens ({new_tokens}); use seq_len >= {prompt_len + new_tokens}"
        )
    if rl.algorithm != "dpo":
        RewardSet(rl.rewards, rl.reward_weights)
