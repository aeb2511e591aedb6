"""Offline verifiable digit tasks for reinforcement learning, on their own 16-token vocabulary.

A prompt is `[BOS d1 .. dn SEP]` (add: `[BOS a1 .. an PLUS b1 .. bn SEP]`); the answer is the
task's digits followed by EOS (reverse: the digits backwards; sort: ascending; add: the decimal
digits of a + b, without leading zeros). Nothing is downloaded: every prompt comes from a seeded
generator. The vocabulary is tiny on purpose: with a 4k-token vocabulary a randomly initialized
policy almost never samples a digit, every group scores 0 and GRPO's gradient is 0
(`../shared/notes/grpo_design.md`, "A verifiable offline task").

A fixed share of all digit strings (one in `HELD_OUT_EVERY` by a hash) is held out: the training
stream never draws them, and the greedy evaluation uses only them.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

DIGITS = 10
BOS, SEP, EOS, PLUS = 10, 11, 12, 13
VOCAB_SIZE = 16  # ids 14, 15 are never in a prompt or answer; 16 divides over tensor-parallel ranks
HELD_OUT_EVERY = 16
KINDS = ("reverse", "sort", "add")
# One character per id, so a reward reading the text sees position i of the text at token i.
GLYPHS = "0123456789^=$+??"


class DigitVocab:
    """The tokenizer of the digit tasks: id d is the digit d, then BOS, SEP, EOS, PLUS; as text
    one character each: the digit, `^`, `=`, `$`, `+` (`?` for the two unused ids).

    Offers what the trainer reads from a tokenizer (`vocab_size`, `bos_id`, `eos_id`, `eot_id`,
    `pad_id`, `path`, `fingerprint`, `encode`, `decode`).
    """

    vocab_size = VOCAB_SIZE
    bos_id = BOS
    eos_id = EOS
    eot_id = EOS
    pad_id = EOS
    path = "digit-task-vocab"
    fingerprint = "digit-task-vocab-v1"

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Digits and `+` of `text` (other characters are ignored), with BOS/EOS when asked."""
        ids = [int(c) if c.isdigit() else PLUS for c in text if c.isdigit() or c == "+"]
        return ([BOS] if bos else []) + ids + ([EOS] if eos else [])

    def decode(self, ids: Sequence[int]) -> str:
        """One character per id (`GLYPHS`)."""
        return "".join(GLYPHS[i] for i in ids)


@dataclass(frozen=True)
class DigitTask:
    """`kind` ("reverse", "sort" or "add") over strings of `digits` digits (add: two numbers
    of `digits` digits each, leading zeros allowed).

    Raises:
        ValueError: an unknown kind or fewer than 1 digit.
    """

    kind: str
    digits: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"task {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.digits < 1:
            raise ValueError(f"task digits={self.digits} must be >= 1")

    @property
    def operands(self) -> int:
        return 2 if self.kind == "add" else 1

    @property
    def prompt_len(self) -> int:
        return self.operands * (self.digits + 1) + 1

    @property
    def answer_len(self) -> int:
        """Most tokens of a right answer, EOS included (a sum may have one digit more)."""
        return self.digits + (2 if self.kind == "add" else 1)

    def answer(self, digits: Sequence[int]) -> list[int]:
        """The right completion's ids (EOS last) for a prompt's digits (add: both operands)."""
        if self.kind == "reverse":
            return [*reversed(digits), EOS]
        if self.kind == "sort":
            return [*sorted(digits), EOS]
        a = int("".join(map(str, digits[: self.digits])))
        b = int("".join(map(str, digits[self.digits :])))
        return [*map(int, str(a + b)), EOS]

    def example(self, digits: Sequence[int]) -> tuple[list[int], dict]:
        """(prompt ids, metadata) for one digit string (add: both operands, concatenated).
        metadata: `target`, the right completion's ids with EOS; `answer`, its text without."""
        if self.kind == "add":
            prompt = [BOS, *digits[: self.digits], PLUS, *digits[self.digits :], SEP]
        else:
            prompt = [BOS, *digits, SEP]
        target = self.answer(digits)
        return prompt, {"target": target, "answer": "".join(map(str, target[:-1]))}

    def draw(self, rng: random.Random, held_out: bool) -> tuple[list[int], dict]:
        """A random example from the held-out share (`held_out`) or from the rest."""
        for _ in range(100 * HELD_OUT_EVERY):
            digits = [rng.randrange(DIGITS) for _ in range(self.digits * self.operands)]
            if is_held_out(digits) == held_out:
                return self.example(digits)
        raise ValueError(
            f"strings of {self.digits} digits have no {'held-out' if held_out else 'training'} "
            "share; use task_digits >= 3"
        )

    def preference_pair(
        self, rng: random.Random, held_out: bool
    ) -> tuple[list[int], list[int], list[int]]:
        """(prompt, chosen, rejected): the right answer, and the right answer with one digit
        changed (both end with EOS)."""
        prompt, meta = self.draw(rng, held_out)
        chosen = meta["target"]
        rejected = list(chosen)
        at = rng.randrange(len(chosen) - 1)
        rejected[at] = (rejected[at] + rng.randrange(1, DIGITS)) % DIGITS
        return prompt, chosen, rejected

    def held_out_set(self, n: int, seed: int) -> list[tuple[list[int], dict]]:
        """`n` distinct held-out examples (fewer when the held-out share has fewer strings)."""
        rng = random.Random(f"held-out:{seed}")
        available = max(1, DIGITS**self.digits // HELD_OUT_EVERY)
        seen: dict[tuple[int, ...], tuple[list[int], dict]] = {}
        for _ in range(50 * n):
            if len(seen) >= min(n, available):
                break
            prompt, meta = self.draw(rng, held_out=True)
            seen.setdefault(tuple(prompt), (prompt, meta))
        return list(seen.values())


def is_held_out(digits: Sequence[int]) -> bool:
    """Whether a digit string belongs to the held-out share (a stable hash, not Python's)."""
    key = hashlib.sha256(bytes(digits)).digest()
    return key[0] % HELD_OUT_EVERY == 0
