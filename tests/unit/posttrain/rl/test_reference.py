"""The LoRA reference: the policy with its adapters off computes the base model exactly, costs no
second model, and leaves the adapters on after each forward."""

from __future__ import annotations

import copy
import dataclasses

import torch

from titanlab.config.peft import Peft
from titanlab.data.digit_tasks import VOCAB_SIZE
from titanlab.models.registry import build_model, get_family, get_flavor
from titanlab.peft.lora import LoRALinear, apply_lora
from titanlab.posttrain.rl.reference import AdaptersOff


def test_adapters_off_is_the_base_model_and_the_adapters_come_back():
    args = dataclasses.replace(get_flavor(get_family("llama3"), "debugmodel_tiny"),
                               vocab_size=VOCAB_SIZE, max_seq_len=32)  # fmt: skip
    torch.manual_seed(0)
    base = build_model(args)
    base.init_weights()
    policy = copy.deepcopy(base)
    apply_lora(policy, Peft(method="lora", rank=4, alpha=8.0, target_modules=["wq", "wv", "w2"]))
    for m in policy.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_b.weight, std=0.5)  # adapters that change the output
    tokens = torch.randint(0, VOCAB_SIZE, (3, 9))
    reference = AdaptersOff(policy)
    with torch.no_grad():
        want, adapted = base(tokens), policy(tokens)
        got = reference(tokens)
    assert torch.equal(got, want)
    assert (adapted - want).abs().max() > 1e-2  # the adapters are back on after the forward
    assert torch.equal(policy(tokens), adapted)
    assert {id(p) for p in reference.parameters()} == {id(p) for p in policy.parameters()}
