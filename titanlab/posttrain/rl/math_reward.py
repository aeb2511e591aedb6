"""A math answer checker reward through `math-verify` (Hugging Face's answer parser and
verifier: LaTeX, `\\boxed{}`, plain numbers and expressions, sets and intervals compared by
value with SymPy): `titanlab.posttrain.rl.math_reward:math_answer` in `rl.rewards`.

Needs `pip install math-verify` (the `rl` extra); naming it without the package is refused
before launch with one line (the module's import fails in `load_reward`).
"""

from __future__ import annotations

import re

from math_verify import parse, verify

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def math_answer(prompt: str, completion: str, metadata: dict) -> float:
    """1.0 when the answer math-verify finds in the completion equals the reference
    `metadata["answer"]` by value (e.g. `\\boxed{\\frac{1}{2}}` against `0.5`), else 0.0;
    0.0 when either has no parsable answer. A completion in DeepSeek-R1's format is judged on
    the text of its last `<answer>…</answer>`."""
    tagged = _ANSWER_TAG.findall(completion)
    gold = parse(_as_math(metadata["answer"]))
    predicted = parse(tagged[-1] if tagged else completion)
    if not gold or not predicted:
        return 0.0
    return float(verify(gold, predicted))


def _as_math(answer: str) -> str:
    """A bare reference answer (`42`, `\\frac12`) wrapped in `$…$`, so math-verify parses it
    as one expression, as the datasets' ground truths are read."""
    text = answer.strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"
