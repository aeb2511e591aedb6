"""The digit tasks: answers, the vocabulary, and the held-out share."""

from __future__ import annotations

import random

import pytest

from titanlab.data.digit_tasks import BOS, EOS, SEP, VOCAB_SIZE, DigitTask, DigitVocab, is_held_out


def test_prompts_and_answers():
    reverse, sort = DigitTask("reverse", 4), DigitTask("sort", 4)
    prompt, meta = reverse.example([3, 1, 4, 1])
    assert prompt == [BOS, 3, 1, 4, 1, SEP] and meta["target"] == [1, 4, 1, 3, EOS]
    assert sort.example([3, 1, 4, 1])[1]["target"] == [1, 1, 3, 4, EOS]
    assert (reverse.prompt_len, reverse.answer_len) == (6, 5)
    vocab = DigitVocab()
    assert vocab.decode(prompt) == "<bos>3141<sep>" and vocab.encode("3141", bos=True, eos=True) == [
        BOS, 3, 1, 4, 1, EOS,
    ]  # fmt: skip
    assert VOCAB_SIZE % 2 == 0 and max(BOS, SEP, EOS) < VOCAB_SIZE
    with pytest.raises(ValueError, match="task 'add' is not one of reverse, sort"):
        DigitTask("add", 4)


def test_held_out_share_is_stable():
    rng = random.Random(0)
    strings = [[rng.randrange(10) for _ in range(4)] for _ in range(4000)]
    share = sum(map(is_held_out, strings)) / len(strings)
    assert 0.04 < share < 0.09  # one in 16
