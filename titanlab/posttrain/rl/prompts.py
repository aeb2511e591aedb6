"""The prompt stream of a reinforcement-learning run: this data-parallel rank's prompts, in a
reproducible order, with a position that is checkpointed like the data loader's.

Two sources: an offline digit task (`titanlab.data.digit_tasks`), or a JSONL file of
`{"prompt": str, "answer": str, ...}` lines, the prompt rendered as a user turn with the
tokenizer's chat template (`titanlab.data.chat.render_chat_prompt`), the answer and any other
field of the line handed to the reward functions as metadata. Line i of the file is held out for
evaluation when i % 16 == 0 (never drawn for training), as DPO's pairs are.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from titanlab.config.errors import ConfigError
from titanlab.data.chat import render_chat_prompt
from titanlab.data.digit_tasks import EOS, HELD_OUT_EVERY, DigitTask, DigitVocab


@dataclass
class Example:
    """One prompt: ids (its tokens, BOS first), text (what reward functions see as the prompt),
    metadata (`answer` and the source's other fields)."""

    ids: list[int]
    text: str
    metadata: dict[str, Any]


def read_prompts(path: str, tokenizer: Any) -> tuple[list[Example], list[int]]:
    """Every prompt of the JSONL file at `path`, tokenized, and the template's stop ids (the
    first one ends a completion). Raises ConfigError (one line naming the line) for a missing
    file, bad JSON, a missing or non-string `prompt` / `answer`, or fewer than 17 lines."""
    examples: list[Example] = []
    stop_ids: list[int] = []
    for where, row in jsonl_rows(path, ("prompt", "answer")):
        if not row["prompt"].strip():
            raise ConfigError(f'{where}: "prompt" is empty')
        rendered = render_chat_prompt(tokenizer, [{"role": "user", "content": row["prompt"]}])
        stop_ids = rendered.stop_ids
        metadata = {k: v for k, v in row.items() if k != "prompt"}
        examples.append(Example(rendered.ids, row["prompt"], metadata))
    if len(examples) < HELD_OUT_EVERY + 1:
        raise ConfigError(
            f"rl.data_path={path!r} has {len(examples)} prompts; at least "
            f"{HELD_OUT_EVERY + 1} are needed (one in {HELD_OUT_EVERY} is held out)"
        )
    return examples, stop_ids


def jsonl_rows(path: str, keys: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) for each non-blank line of the JSONL file at `path` (`rl.data_path`), every
    one a dict with a string under each of `keys`; `where` names the line for errors. Raises
    ConfigError (one line) for a missing file, bad JSON or a missing / non-string key."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except OSError as e:
        raise ConfigError(f"rl.data_path={path!r} cannot be read: {e.strerror}") from None
    rows = []
    for i, line in enumerate(lines, 1):
        where = f"rl.data_path={path!r} line {i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where} is not JSON: {e.msg}") from None
        for key in keys:
            if not isinstance(row, dict) or not isinstance(row.get(key), str):
                raise ConfigError(f'{where} needs a string "{key}" (keys: {", ".join(keys)})')
        rows.append((where, row))
    return rows


class PromptStream:
    """This data-parallel rank's training prompts. Digit task: prompt i of rank r is drawn from
    its own generator seeded by (seed, r, i). JSONL: it is the (i·dp + r)-th of the training
    lines in an order reshuffled every epoch. Either way the stream's whole state is how many
    prompts it has handed out (`state_dict`), and a resumed run draws exactly what an
    uninterrupted one would. Held-out prompts (the evaluation set) are never drawn.

    Args:
        source: a DigitTask, or the examples of `read_prompts`.
        seed: `debug.seed`.
        dp_rank: this rank's data-parallel index.
        dp: the data-parallel degree.
        tokenizer: a JSONL source's tokenizer.
        stop_ids: the template's stop ids (a JSONL source).
        format_pattern: `rl.format_pattern`, put in every prompt's metadata unless it has one.
    """

    def __init__(
        self, source: DigitTask | list[Example], seed: int, dp_rank: int, dp: int = 1, *,
        tokenizer: Any = None, stop_ids: list[int] | None = None, format_pattern: str = "",
    ) -> None:  # fmt: skip
        self.source, self.seed, self.dp_rank, self.dp = source, seed, dp_rank, dp
        self.drawn = 0
        self.reference = ""  # what the run's reference policy is (`check_reference`)
        self.format_pattern = format_pattern
        if isinstance(source, DigitTask):
            self.tokenizer: Any = DigitVocab()
            self.stop_ids = [EOS]
        else:
            self.tokenizer, self.stop_ids = tokenizer, list(stop_ids or [tokenizer.eos_id])
            self.train = [e for i, e in enumerate(source) if i % HELD_OUT_EVERY]
            self.held_out = [e for i, e in enumerate(source) if i % HELD_OUT_EVERY == 0]

    @property
    def task(self) -> DigitTask | None:
        return self.source if isinstance(self.source, DigitTask) else None

    def next(self, n: int) -> list[Example]:
        """The next `n` training prompts of this rank."""
        out = []
        for _ in range(n):
            if isinstance(self.source, DigitTask):
                rng = random.Random(f"prompt:{self.seed}:{self.dp_rank}:{self.drawn}")
                out.append(self._digit_example(*self.source.draw(rng, held_out=False)))
            else:
                index = self.drawn * self.dp + self.dp_rank
                epoch, at = divmod(index, len(self.train))
                order = list(range(len(self.train)))
                random.Random(f"prompts:{self.seed}:{epoch}").shuffle(order)
                out.append(self._with_pattern(self.train[order[at]]))
            self.drawn += 1
        return out

    def evaluation_prompts(self, n: int) -> list[Example]:
        """At most `n` held-out prompts, the same on every rank."""
        if isinstance(self.source, DigitTask):
            held = self.source.held_out_set(n, self.seed)
            return [self._digit_example(ids, meta) for ids, meta in held]
        return [self._with_pattern(e) for e in self.held_out[:n]]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _digit_example(self, ids: list[int], metadata: dict) -> Example:
        return self._with_pattern(Example(ids, self.tokenizer.decode(ids), metadata))

    def _with_pattern(self, example: Example) -> Example:
        if not self.format_pattern or "format_pattern" in example.metadata:
            return example
        metadata = {**example.metadata, "format_pattern": self.format_pattern}
        return Example(example.ids, example.text, metadata)

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "prompts": self._name(), "reference": self.reference}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the prompts `state` counts. Raises ConfigError when it is the state of
        another source."""
        if state.get("prompts") != self._name():
            raise ConfigError(
                f"the checkpoint's prompts are {state.get('prompts')}, this run's are "
                f"{self._name()}; resume with the same rl.task, rl.task_digits and rl.data_path"
            )
        check_reference(state, self.reference)
        self.drawn = int(state["drawn"])

    def _name(self) -> str:
        if isinstance(self.source, DigitTask):
            return f"task {self.source.kind} of {self.source.digits} digits"
        return f"{len(self.source)} JSONL prompts"


def check_reference(state: dict[str, Any], reference: str) -> None:
    """A resumed run must compare against the reference policy it started with (it is rebuilt,
    not stored). Raises ConfigError (one line) when the checkpoint names another one."""
    saved = state.get("reference", reference)
    if saved != reference:
        raise ConfigError(
            f"the checkpoint was trained against the reference policy {saved}, this run's is "
            f"{reference}; resume with the same checkpoint.initial_load_path and debug.seed"
        )
