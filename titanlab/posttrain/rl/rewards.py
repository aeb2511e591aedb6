"""Reward functions: `(prompt, completion, metadata) -> float`, named in the config as
`module:function` and combined by weights (`rl.rewards`, `rl.reward_weights`).

`prompt` and `completion` are lists of token ids (the completion ends at its first EOS,
included, when it has one); `metadata` is the task's dict for the prompt (the digit tasks give
`target`, the right completion's ids with EOS). Functions must be deterministic and cheap: each
rank scores only its own completions.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Sequence

import torch

from titanlab.config.errors import ConfigError
from titanlab.data.digit_tasks import EOS

RewardFn = Callable[[Sequence[int], Sequence[int], dict], float]


def partial_credit(prompt: Sequence[int], completion: Sequence[int], metadata: dict) -> float:
    """Fraction of the target's positions (EOS included) the completion gets right, in [0, 1]:
    a signal from the first step on, where exact match would give all-zero groups."""
    target = metadata["target"]
    right = sum(1 for a, b in zip(completion, target) if a == b)
    return right / len(target)


def exact_match(prompt: Sequence[int], completion: Sequence[int], metadata: dict) -> float:
    """1.0 when the completion is exactly the target (EOS included), else 0.0."""
    return float(list(completion) == list(metadata["target"]))


def ends_with_eos(prompt: Sequence[int], completion: Sequence[int], metadata: dict) -> float:
    """Format reward: 1.0 when the completion ended (sampled EOS) within max_new_tokens."""
    return float(bool(completion) and completion[-1] == metadata.get("eos_id", EOS))


def load_reward(spec: str, index: int) -> RewardFn:
    """The function named `module:function`. Raises ConfigError (one line) when it cannot be
    imported or is not callable."""
    where = f"rl.rewards[{index}]={spec!r}"
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{where} must be `module:function`, e.g. {__name__}:partial_credit")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(f"{where} cannot be imported: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{where}: module {module_name} has no function {attr}")
    return fn


class RewardSet:
    """The weighted sum of the configured reward functions, each also reported on its own.

    Raises (from `score`): ConfigError, one line naming the `rl.rewards` entry, when a function
    returns a non-number or a non-finite one.
    """

    def __init__(self, specs: Sequence[str], weights: Sequence[float]) -> None:
        self.names = [s.rpartition(":")[2] for s in specs]
        self.fns = [load_reward(s, i) for i, s in enumerate(specs)]
        self.specs = list(specs)
        self.weights = list(weights) if weights else [1.0] * len(self.fns)

    def score(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
        metadata: Sequence[dict],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
        """(total (B,) float32, {name: (B,) float32 per function})."""
        per_fn: dict[str, torch.Tensor] = {}
        total = torch.zeros(len(completions))
        for i, (spec, name, fn, w) in enumerate(
            zip(self.specs, self.names, self.fns, self.weights)
        ):
            values: list[float] = []
            for p, c, m in zip(prompts, completions, metadata):
                v = fn(p, c, m)
                if not isinstance(v, numbers.Real) or not math.isfinite(v):
                    raise ConfigError(
                        f"rl.rewards[{i}]={spec!r} returned {v!r} ({type(v).__name__}); a "
                        "reward function must return a finite float"
                    )
                values.append(float(v))
            scores = torch.tensor(values, dtype=torch.float32)
            per_fn[name] = scores
            total += w * scores
        return total, per_fn
