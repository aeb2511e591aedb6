"""A reward for the JSONL prompt test (imported by the trainer as `rl_text_rewards:length`, with
tests/integration on PYTHONPATH): it checks what a reward function is handed, then rewards
length, which a random policy varies, so groups have non-zero advantages."""

from __future__ import annotations

import re


def length(prompt: str, completion: str, metadata: dict) -> float:
    """len(completion) / 50, after checking the prompt is the line's text and the metadata its
    answer and fields (raises otherwise: the run stops with one line naming this function)."""
    a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", prompt).groups())
    assert metadata["answer"] == str(a + b) and metadata["source"] == "test", metadata
    assert isinstance(metadata["finished"], bool) and metadata["completion_ids"], metadata
    return len(completion) / 50
