"""The `[rl]` section: reinforcement learning from verifiable rewards (GRPO) on the same stack."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from titanlab.config.errors import _require

DIGIT_TASKS = ("reverse", "sort", "add")
R1_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"


@dataclass
class RL:
    algorithm: Literal["none", "grpo", "ppo", "dpo"] = "none"
    """none: pretraining / SFT on `[data]`. grpo: Group Relative Policy Optimization (Shao et
    al. 2024, arXiv:2402.03300 §4.1): each data-parallel rank draws its own prompts, the policy
    module samples `group_size` completions of each through its KV cache (no second engine, no
    weight copy), the reward functions score them, and the step minimizes the clipped surrogate
    of the group-normalized advantages plus `beta` · k3 KL to the initial model.
    `training.local_batch_size` counts completions per rank (prompts × group_size).
    ppo: Proximal Policy Optimization (Schulman et al. 2017; the RLHF recipe of Ouyang et al.
    2022) with a value head on the policy's trunk, GAE (`gamma`, `lam`), the clipped value loss,
    and `beta` · (log π_old − log π_ref) subtracted from each token's reward; same rollouts.
    dpo: Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290) on preference
    pairs (`rl.data_path`, or pairs of the digit task: its answer against the answer with one
    digit changed), `beta` its β, the frozen initial model the reference;
    `training.local_batch_size` counts pairs per rank."""

    data_path: str = ""
    """A JSONL file, the prompt of each line rendered as a user turn with the tokenizer's chat
    template (`model.tokenizer_path`); one line in 16 held out for evaluation. grpo, ppo:
    `{"prompt", "answer", ...}` strings, the answer and the other fields handed to the reward
    functions (`rl.max_new_tokens` required); dpo: `{"prompt", "chosen", "rejected"}`, prompt
    tokens masked. Empty: the digit task (`rl.task`) on its own vocabulary."""

    task: Literal["reverse", "sort", "add"] = "reverse"
    """Prompt source without `data_path`: an offline verifiable task generated from
    `debug.seed`, on its own 16-token vocabulary (digits, BOS, SEP, EOS, PLUS; the model's
    vocab_size comes from it): reverse or sort a string of `task_digits` digits, or add two
    numbers of `task_digits` digits. The answer is the digits then EOS."""

    task_digits: int = 4
    """Digits per prompt of the task (add: per number)."""

    group_size: int = 8
    """G: completions sampled per prompt; GRPO normalizes the advantages within each group
    (G >= 2), PPO's come from its value head (G >= 1)."""

    max_new_tokens: int = 0
    """Most tokens sampled per completion; 0: the digit task's answer length (digits + EOS;
    required with `data_path`)."""

    temperature: float = 1.0
    """Sampling temperature (> 0) over the full vocabulary; the trainer's log-probabilities use
    the same one (logits ÷ temperature)."""

    top_k: int = 0
    """Sample among the k most likely tokens only (0: all). The ratio then uses log-probabilities
    of the untruncated distribution, as TRL does."""

    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1] (1: off)."""

    epsilon_low: float = 0.2
    """Clip range below 1 of the ratio π_θ/π_old (PPO's ε; Schulman et al. 2017)."""

    epsilon_high: float = 0.2
    """Clip range above 1; DAPO's clip-higher uses 0.28 (Yu et al. 2025, arXiv:2503.14476)."""

    beta: float = 0.0
    """grpo: weight of the k3 KL estimate to the reference (the initial model; DeepSeekMath
    eq. 4), 0 builds no reference model (DAPO, Dr. GRPO). dpo: β of the implicit reward
    (> 0, e.g. 0.1)."""

    gamma: float = 1.0
    """ppo: discount γ of GAE over a completion's tokens."""

    lam: float = 0.95
    """ppo: λ of GAE (Schulman et al. 2016)."""

    value_coef: float = 0.1
    """ppo: weight of the value loss in the total loss."""

    value_clip: float = 0.2
    """ppo: the value's clip range around the rollout's value (PPO2's cliprange_value)."""

    whiten_advantages: bool = True
    """ppo: normalize the advantages to mean 0, std 1 over the counted tokens of the global
    batch."""

    scale_rewards: bool = True
    """Divide each group's centred rewards by their std (+1e-6); false: Dr. GRPO's r − mean
    (Liu et al. 2025, arXiv:2503.20783)."""

    loss_aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"
    """token_mean: Σ over every completion token of the global batch ÷ their number (DAPO; the
    project's convention, independent of the layout); sequence_mean: the paper's mean of each
    completion's token mean."""

    iterations: int = 1
    """μ: optimizer steps on each rollout batch; after the first, the ratio to the sampling
    policy (π_old) is no longer 1 and the clip acts. `training.steps` counts rollouts; the μ
    steps of one rollout share its learning rate."""

    dynamic_sampling: bool = False
    """Drop the groups whose rewards are all equal (zero advantage) from the loss (DAPO)."""

    mask_truncated: bool = False
    """Leave completions that reached max_new_tokens without EOS out of the loss."""

    rewards: list[str] = field(
        default_factory=lambda: ["titanlab.posttrain.rl.rewards:partial_credit"]
    )
    """Reward functions `module:function`, each `(prompt, completion, metadata) -> float` on the
    prompt's and the completion's text and the prompt's metadata (`answer`, `finished`, ...;
    `titanlab.posttrain.rl.rewards`). Built in (titanlab.posttrain.rl.rewards): partial_credit,
    exact_match, ends_with_eos, matches_format (`format_pattern`); and
    titanlab.posttrain.rl.math_reward:math_answer, the math-verify checker (pip install
    math-verify)."""

    reward_weights: list[float] = field(default_factory=list)
    """Weight of each reward function in the sum (empty: 1 each)."""

    format_pattern: str = R1_FORMAT
    """The regular expression `matches_format` wants the whole completion to match (`.` also
    matches newlines); default DeepSeek-R1's `<think>…</think> <answer>…</answer>`. A JSONL
    line's own `format_pattern` field wins."""

    eval_freq: int = 25
    """Every this many steps (and at the last), greedy exact-match on `eval_prompts` held-out
    prompts (never drawn for training); 0: off."""

    eval_prompts: int = 64
    """Held-out prompts of the greedy evaluation (dpo: held-out pairs)."""

    rollout_keep_gathered: bool = False
    """Keep FSDP's gathered weights for the whole rollout (one all-gather per module instead of
    one per module per decode step), then reshard every module; costs the whole unsharded
    model's memory during the rollout."""

    def validate(self) -> None:
        if self.algorithm == "none":
            return
        _require(
            3 <= self.task_digits <= 64,
            f"rl.task_digits={self.task_digits} must be in [3, 64] (fewer digits leave no "
            "held-out prompts)",
        )
        _require(
            self.group_size >= 2 or (self.algorithm != "grpo" and self.group_size == 1),
            f"rl.group_size={self.group_size} must be >= 2 (a group of 1 has no relative advantage)"
            if self.algorithm == "grpo"
            else f"rl.group_size={self.group_size} must be >= 1",
        )
        _require(self.max_new_tokens >= 0, f"rl.max_new_tokens={self.max_new_tokens} must be >= 0")
        _require(
            self.temperature > 0,
            f"rl.temperature={self.temperature} must be > 0 (GRPO samples its completions)",
        )
        _require(self.top_k >= 0, f"rl.top_k={self.top_k} must be >= 0 (0: all tokens)")
        _require(0 < self.top_p <= 1, f"rl.top_p={self.top_p} must be in (0, 1]")
        for name in ("epsilon_low", "epsilon_high"):
            value = getattr(self, name)
            _require(0 <= value < 1, f"rl.{name}={value} must be in [0, 1)")
        _require(self.beta >= 0, f"rl.beta={self.beta} must be >= 0")
        _require(
            self.algorithm != "dpo" or self.beta > 0,
            f"rl.beta={self.beta}: DPO's β must be > 0 (e.g. 0.1)",
        )
        _require(
            not self.data_path or self.algorithm == "dpo" or self.max_new_tokens > 0,
            f"rl.data_path with rl.algorithm={self.algorithm} needs rl.max_new_tokens > 0 (the "
            "longest completion to sample)",
        )
        try:
            re.compile(self.format_pattern)
        except re.error as e:
            _require(False, f"rl.format_pattern={self.format_pattern!r} is not a regular "
                            f"expression: {e}")  # fmt: skip
        _require(self.iterations >= 1, f"rl.iterations={self.iterations} must be >= 1")
        _require(0 < self.gamma <= 1, f"rl.gamma={self.gamma} must be in (0, 1]")
        _require(0 <= self.lam <= 1, f"rl.lam={self.lam} must be in [0, 1]")
        _require(self.value_coef >= 0, f"rl.value_coef={self.value_coef} must be >= 0")
        _require(self.value_clip > 0, f"rl.value_clip={self.value_clip} must be > 0")
        _require(bool(self.rewards), "rl.rewards must name at least one `module:function`")
        _require(
            not self.reward_weights or len(self.reward_weights) == len(self.rewards),
            f"rl.reward_weights has {len(self.reward_weights)} values for "
            f"{len(self.rewards)} rl.rewards; give one per function or none",
        )
        _require(self.eval_freq >= 0, f"rl.eval_freq={self.eval_freq} must be >= 0")
        _require(self.eval_prompts >= 1, f"rl.eval_prompts={self.eval_prompts} must be >= 1")


def validate_rl_combinations(config: Any) -> None:
    """What reinforcement learning composes with in this version (`config` a JobConfig): one
    line per refusal. LoRA: GRPO and DPO train the adapters, the reference being the base
    (adapters off); PPO's value head would train outside the adapters, and sampling needs the
    policy without adapter dropout."""
    rl, par, name = config.rl, config.parallelism, f"rl.algorithm={config.rl.algorithm}"
    peft = config.peft
    _require(
        rl.algorithm == "dpo" or config.training.local_batch_size % rl.group_size == 0,
        f"training.local_batch_size={config.training.local_batch_size} (completions per rank) "
        f"is not a multiple of rl.group_size={rl.group_size}; use a multiple of it",
    )
    refused = {
        "parallelism.pipeline_parallel_degree": par.pipeline_parallel_degree > 1,
        "parallelism.context_parallel_degree": par.context_parallel_degree > 1,
        "compile.enable": config.compile.enable,
        "peft.method": peft.method != "none" and rl.algorithm == "ppo",
        "peft.quantize_base": peft.quantize_base != "none",
        "distill.teacher_path": bool(config.distill.teacher_path),
        "float8.enable": config.float8.enable,
        "validation.enable": config.validation.enable,
    }
    for option, on in refused.items():
        section, field_name = option.split(".")
        value = getattr(getattr(config, section), field_name)
        hint = {
            "validation.enable": "use rl.eval_freq for held-out evaluation",
            "peft.method": "LoRA composes with rl.algorithm grpo and dpo",
        }.get(option, f"leave {option} at its default")
        _require(not on, f"{name} with {option}={value} is not supported; {hint}")
    _require(
        peft.method == "none" or peft.dropout == 0 or rl.algorithm == "dpo",
        f"{name} with peft.dropout={peft.dropout} is not supported: the policy that samples "
        "must be the one trained; use peft.dropout = 0",
    )
