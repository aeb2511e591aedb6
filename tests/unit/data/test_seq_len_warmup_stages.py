"""Sequence-length warmup: the stages, the split of windows into rows, the config's one-line
errors."""

import pytest
import torch

from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.data.seq_len_warmup import split_windows, warmup_seq_len


def test_stages_double_in_equal_parts_up_to_seq_len():
    lengths = [warmup_seq_len(s, 64, 16, 12) for s in range(1, 15)]
    assert lengths == [16] * 4 + [32] * 4 + [64] * 6
    assert [warmup_seq_len(s, 64, 16, 0) for s in (1, 5)] == [64, 64]
    assert warmup_seq_len(1, 64, 64, 10) == 64


def test_split_keeps_every_next_token_pair():
    window = torch.arange(17)[None]  # one window of seq_len 16 (+1)
    inputs, labels = split_windows(window[:, :-1], window[:, 1:], 4)
    assert inputs.shape == labels.shape == (4, 4)
    assert torch.equal(labels, inputs + 1)  # each row's targets are its next tokens
    assert inputs.flatten().tolist() == list(range(16))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.seq_len_warmup_steps", "-1"], "training.seq_len_warmup_steps=-1 must be >= 0"),
        (["--training.seq_len_warmup_steps", "10", "--training.seq_len", "96",
          "--training.seq_len_warmup_start", "32"],
         "training.seq_len_warmup_start=32 must be training.seq_len=96 divided by a power of two"),
    ],
)  # fmt: skip
def test_bad_warmup_is_one_line(args, message):
    with pytest.raises(ConfigError, match=message) as e:
        build_config(args)
    assert "\n" not in str(e.value)
