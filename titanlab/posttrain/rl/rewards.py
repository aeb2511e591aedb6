"""Reward functions: `(prompt, completion, metadata) -> float`, named in the config as
`module:function` and combined by weights (`rl.rewards`, `rl.reward_weights`).

`prompt` is the prompt's text (a JSONL line's `"prompt"` as written, before the chat template; a
digit task's one character per token, `titanlab.data.digit_tasks.GLYPHS`); `completion` is the
decoded text of the sampled tokens before the first stop token (EOS / end of turn). `metadata`
is a fresh dict per completion: the prompt's fields (`answer`, the reference answer's text; a
JSONL line's other fields; a digit task's `target` ids) plus `finished` (the completion ended
with a stop token within `rl.max_new_tokens`), `completion_ids` (its token ids, the stop token
included when finished) and `format_pattern` (`rl.format_pattern`, unless the line sets its
own). Functions must be deterministic and cheap: each rank scores only its own completions.
The arguments follow TRL's reward functions (prompts, completions, dataset columns as keyword
arguments) and verl's `compute_score` (solution string, ground truth), one completion a call.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable, Sequence

import torch

from titanlab.config.errors import ConfigError

RewardFn = Callable[[str, str, dict], float]


def partial_credit(prompt: str, completion: str, metadata: dict) -> float:
    """Share of the answer's positions the completion gets right, stopping right after it
    counting as one more position, in [0, 1]: a signal from the first step on, where exact
    match gives all-zero groups. On a digit task this is the share of the target's tokens (EOS
    included) sampled right."""
    answer = metadata["answer"]
    right = sum(1 for a, b in zip(completion, answer) if a == b)
    right += bool(metadata["finished"]) and len(completion) == len(answer)
    return right / (len(answer) + 1)


def exact_match(prompt: str, completion: str, metadata: dict) -> float:
    """1.0 when the completion stopped and is the answer (surrounding whitespace ignored)."""
    finished = bool(metadata["finished"])
    return float(finished and completion.strip() == metadata["answer"].strip())


def ends_with_eos(prompt: str, completion: str, metadata: dict) -> float:
    """Format reward: 1.0 when the completion stopped (sampled EOS / end of turn) within
    `rl.max_new_tokens`."""
    return float(bool(metadata["finished"]))


def matches_format(prompt: str, completion: str, metadata: dict) -> float:
    """Format reward: 1.0 when the whole completion matches `metadata["format_pattern"]` (a
    Python regular expression, `.` matching newlines too), e.g. DeepSeek-R1's
    `<think>…</think><answer>…</answer>` (`rl.format_pattern`)."""
    return float(re.fullmatch(metadata["format_pattern"], completion, re.DOTALL) is not None)


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
    raises, or returns a non-number or a non-finite one.
    """

    def __init__(self, specs: Sequence[str], weights: Sequence[float]) -> None:
        self.names = [s.rpartition(":")[2] for s in specs]
        self.fns = [load_reward(s, i) for i, s in enumerate(specs)]
        self.specs = list(specs)
        self.weights = list(weights) if weights else [1.0] * len(self.fns)

    def score(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(total (B,) float32, {name: (B,) float32 per function}) of B completions."""
        per_fn: dict[str, torch.Tensor] = {}
        total = torch.zeros(len(completions))
        for i, (spec, name, fn, w) in enumerate(
            zip(self.specs, self.names, self.fns, self.weights)
        ):
            values: list[float] = []
            for p, c, m in zip(prompts, completions, metadata):
                try:
                    v = fn(p, c, m)
                except Exception as e:
                    raise ConfigError(
                        f"rl.rewards[{i}]={spec!r} raised {type(e).__name__}: {e} (on the "
                        f"completion {c[:40]!r})"
                    ) from None
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
