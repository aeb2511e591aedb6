"""The FLOPs per token the trainer's MFU uses for DeepSeek-V3 (active parameters, multi-head
latent attention's widths, the multi-token prediction depth's block and second use of the head)
equal the FLOPs a training step executes, counted by `torch.utils.flop_counter`."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from titanlab.models.common.counting import count_active_params
from titanlab.models.common.mtp import mtp_targets
from titanlab.models.deepseek_v3 import deepseek_v3_flavors
from titanlab.models.registry import build_model, get_family

BATCH, SEQ, VOCAB = 2, 256, 512


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_deep"])
def test_flops_per_token_equals_the_counted_step(flavor):
    args = dataclasses.replace(deepseek_v3_flavors[flavor], vocab_size=VOCAB, max_seq_len=SEQ)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with FlopCounterMode(display=False) as counter:
        with mtp_targets(model, labels, 0.3):
            logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    active = count_active_params(model, exclude_embedding=True)
    predicted = get_family("deepseek_v3").flops_per_token(args, SEQ, active) * BATCH * SEQ
    ratio = counter.get_total_flops() / predicted
    print(f"{flavor}: counted {counter.get_total_flops():.4g} FLOPs, predicted {predicted:.4g}"
          f" ({ratio:.4f})")  # fmt: skip
    # The MTP depth runs on seq - 1 positions; the formula counts seq.
    assert 0.99 < ratio <= 1.0
