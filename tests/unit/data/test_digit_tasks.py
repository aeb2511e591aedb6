"""The digit tasks: answers, the vocabulary, and the held-out share."""

from __future__ import annotations

import random

import pytest

from titanlab.data.digit_tasks import (
    BOS, EOS, PLUS, SEP, VOCAB_SIZE, DigitTask, DigitVocab, is_held_out,
)  # fmt: skip


def test_prompts_and_answers():
    reverse, sort = DigitTask("reverse", 4), DigitTask("sort", 4)
    prompt, meta = reverse.example([3, 1, 4, 1])
    assert prompt == [BOS, 3, 1, 4, 1, SEP] and meta["target"] == [1, 4, 1, 3, EOS]
    assert sort.example([3, 1, 4, 1])[1]["target"] == [1, 1, 3, 4, EOS]
    assert (reverse.prompt_len, reverse.answer_len) == (6, 5)
    vocab = DigitVocab()
    assert vocab.decode(prompt) == "^3141=" and vocab.encode("3141", bos=True, eos=True) == [
        BOS, 3, 1, 4, 1, EOS,
    ]  # fmt: skip
    assert vocab.decode(list(range(VOCAB_SIZE))) == "0123456789^=$+??"  # one character per id
    assert VOCAB_SIZE % 2 == 0 and max(BOS, SEP, EOS, PLUS) < VOCAB_SIZE
    with pytest.raises(ValueError, match="task 'mul' is not one of reverse, sort, add"):
        DigitTask("mul", 4)


def test_the_add_task_sums_two_numbers_leading_zeros_allowed():
    add = DigitTask("add", 3)
    prompt, meta = add.example([0, 4, 2, 9, 9, 9])
    assert prompt == [BOS, 0, 4, 2, PLUS, 9, 9, 9, SEP]
    assert meta == {"target": [1, 0, 4, 1, EOS], "answer": "1041"}
    assert add.example([0, 0, 1, 0, 0, 2])[1]["answer"] == "3"
    assert (add.prompt_len, add.answer_len) == (9, 5)  # 999 + 999 = 1998: 4 digits and EOS
    assert DigitVocab().encode("42+999", bos=False, eos=False) == [4, 2, PLUS, 9, 9, 9]
    prompt, chosen, rejected = add.preference_pair(random.Random(0), held_out=False)
    assert chosen == add.answer(prompt[1:4] + prompt[5:8])
    assert sum(a != b for a, b in zip(chosen, rejected)) == 1 and rejected[-1] == EOS


def test_held_out_share_is_stable():
    rng = random.Random(0)
    strings = [[rng.randrange(10) for _ in range(4)] for _ in range(4000)]
    share = sum(map(is_held_out, strings)) / len(strings)
    assert 0.04 < share < 0.09  # one in 16
