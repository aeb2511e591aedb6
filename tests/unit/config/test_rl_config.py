"""Bad `[rl]` input: one line naming the value and what would be valid, from the config or the
pre-flight check (before any process group or file exists)."""

from __future__ import annotations

import os

import pytest

from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.planning import preflight

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
GRPO = ["--job.config_file", os.path.join(REPO, "train_configs", "grpo_debug.toml")]

CASES = {
    "group of 1": (["--rl.group_size", "1"], "rl.group_size=1 must be >= 2"),
    "group does not divide": (
        ["--rl.group_size", "6"],
        "training.local_batch_size=128 (completions per rank) is not a multiple of rl.group_size=6",
    ),
    "temperature 0": (["--rl.temperature", "0"], "rl.temperature=0.0 must be > 0"),
    "weights": (["--rl.reward_weights", "1,2"], "rl.reward_weights has 2 values for 1 rl.rewards"),
    "pp": (
        ["--parallelism.pipeline_parallel_degree", "2"],
        "rl.algorithm=grpo with parallelism.pipeline_parallel_degree=2 is not supported",
    ),
    "cp": (
        ["--parallelism.context_parallel_degree", "2"],
        "rl.algorithm=grpo with parallelism.context_parallel_degree=2 is not supported",
    ),
    "lora dropout": (
        ["--peft.method", "lora", "--peft.dropout", "0.1"],
        "rl.algorithm=grpo with peft.dropout=0.1 is not supported: the policy that samples",
    ),
    "qlora": (
        [
            "--peft.method",
            "lora",
            "--peft.quantize_base",
            "nf4",
            "--checkpoint.initial_load_path",
            "/base",
        ],
        "rl.algorithm=grpo with peft.quantize_base=nf4 is not supported",
    ),
    "ppo lora": (
        ["--rl.algorithm", "ppo", "--peft.method", "lora"],
        "rl.algorithm=ppo with peft.method=lora is not supported; LoRA composes with "
        "rl.algorithm grpo and dpo",
    ),
    "jsonl without max_new_tokens": (
        ["--rl.data_path", "prompts.jsonl"],
        "rl.data_path with rl.algorithm=grpo needs rl.max_new_tokens > 0",
    ),
    "format pattern": (["--rl.format_pattern", "(a"], "rl.format_pattern='(a' is not a regular "),
    "too few digits": (["--rl.task_digits", "2"], "rl.task_digits=2 must be in [3, 64]"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_rl_config_is_one_line(case):
    args, says = CASES[case]
    with pytest.raises(ConfigError) as e:
        build_config([*GRPO, *args])
    assert says in str(e.value) and "\n" not in str(e.value)


PREFLIGHT = {
    "reward import": (
        ["--rl.rewards", "no_such_module_abc:score"],
        "rl.rewards[0]='no_such_module_abc:score' cannot be imported: ModuleNotFoundError",
    ),
    "seq_len": (
        ["--training.seq_len", "8"],
        "training.seq_len=8 is shorter than a prompt (6 tokens) + rl.max_new_tokens (5); use "
        "seq_len >= 11",
    ),
    "grad accumulation": (
        ["--training.global_batch_size", "512"],
        "rl.algorithm=grpo takes one rollout batch per step: training.global_batch_size=512",
    ),
}


@pytest.mark.parametrize("case", list(PREFLIGHT))
def test_rl_preflight_refusals_are_one_line_and_write_nothing(case, tmp_path):
    args, says = PREFLIGHT[case]
    dump = tmp_path / "out"
    config = build_config([*GRPO, *args, "--job.dump_folder", str(dump)])
    with pytest.raises(ConfigError) as e:
        preflight.check(config, 2, 2)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert not dump.exists()


def test_the_shipped_grpo_config_passes_preflight_with_the_task_vocabulary(tmp_path):
    config = build_config([*GRPO, "--job.dump_folder", str(tmp_path / "out")])
    plan = preflight.check(config, 2, 2)
    assert plan.model_args.vocab_size == 16 and plan.batch.global_batch_size == 256
