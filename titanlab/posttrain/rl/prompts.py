"""The prompt stream of a reinforcement-learning run: this data-parallel rank's prompts, in a
reproducible order, with a position that is checkpointed like the data loader's."""

from __future__ import annotations

import random
from typing import Any

from titanlab.config.errors import ConfigError
from titanlab.data.digit_tasks import DigitTask


class PromptStream:
    """Prompt i of data-parallel rank r is drawn from its own generator seeded by (seed, r, i),
    so the stream's whole state is how many prompts it has handed out (`state_dict`), and a
    resumed run draws exactly what an uninterrupted one would. Held-out prompts (the evaluation
    set) are never drawn.

    Args:
        task: the digit task; seed: `debug.seed`; dp_rank: this rank's data-parallel index.
    """

    def __init__(self, task: DigitTask, seed: int, dp_rank: int) -> None:
        self.task, self.seed, self.dp_rank = task, seed, dp_rank
        self.drawn = 0
        self.reference = ""  # what the run's reference policy is (`check_reference`)

    def next(self, n: int) -> tuple[list[list[int]], list[dict]]:
        """The next `n` (prompt ids, metadata) of this rank, as two lists."""
        prompts, metadata = [], []
        for _ in range(n):
            rng = random.Random(f"prompt:{self.seed}:{self.dp_rank}:{self.drawn}")
            p, m = self.task.draw(rng, held_out=False)
            prompts.append(p)
            metadata.append(m)
            self.drawn += 1
        return prompts, metadata

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "task": self.task.kind, "digits": self.task.digits,
                "reference": self.reference}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the prompts `state` counts. Raises ConfigError when it is the state of
        another task."""
        if (state.get("task"), state.get("digits")) != (self.task.kind, self.task.digits):
            raise ConfigError(
                f"the checkpoint's prompt stream is task {state.get('task')} of "
                f"{state.get('digits')} digits, this run's is {self.task.kind} of "
                f"{self.task.digits}; resume with the same rl.task and rl.task_digits"
            )
        check_reference(state, self.reference)
        self.drawn = int(state["drawn"])


def check_reference(state: dict[str, Any], reference: str) -> None:
    """A resumed run must compare against the reference policy it started with (it is rebuilt,
    not stored). Raises ConfigError (one line) when the checkpoint names another one."""
    saved = state.get("reference", reference)
    if saved != reference:
        raise ConfigError(
            f"the checkpoint was trained against the reference policy {saved}, this run's is "
            f"{reference}; resume with the same checkpoint.initial_load_path and debug.seed"
        )
