"""LoRA on the output head with the chunked fused loss: the low-rank logits u Bᵀ are added chunk by
chunk, so the loss and the gradients of the hidden states, A and B equal the unfused adapted
head's (fp32, within 1e-5), with dropout too; the adapter keeps its names and can be disabled."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titanlab.components.fused_ce import lora_linear_cross_entropy_sum
from titanlab.components.fused_head import FusedLossHead, fused_targets, use_fused_loss
from titanlab.components.loss import cross_entropy_sum
from titanlab.config.peft import Peft
from titanlab.peft.lora import adapted_modules, adapters_disabled, apply_lora, init_adapters


@pytest.mark.parametrize("chunk_size", [1, 9, 4096])
def test_loss_and_every_gradient_equal_the_unfused_low_rank_head(chunk_size):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 23, 16, generator=g, requires_grad=True)
    weight = 0.3 * torch.randn(40, 16, generator=g)  # frozen, as LoRA's base
    u = torch.randn(2, 23, 4, generator=g, requires_grad=True)
    b = (0.2 * torch.randn(40, 4, generator=g)).requires_grad_()
    labels = torch.randint(0, 40, (2, 23), generator=g)
    labels[1, :4] = -100
    want = cross_entropy_sum(F.linear(hidden, weight) + u @ b.t(), labels)
    want_grads = torch.autograd.grad(1.5 * want, (hidden, u, b))
    got = lora_linear_cross_entropy_sum(hidden, weight, u, b, labels, chunk_size)
    got_grads = torch.autograd.grad(1.5 * got, (hidden, u, b))
    assert abs(got.item() - want.item()) < 1e-4
    for name, w, gt in zip(("hidden", "u", "b"), want_grads, got_grads):
        assert torch.allclose(gt, w, atol=1e-5, rtol=0), name
    weight.requires_grad_(True)  # a trained base head gets its gradient too
    got_w = torch.autograd.grad(lora_linear_cross_entropy_sum(hidden, weight, u, b, labels, 7),
                                weight)[0]  # fmt: skip
    want_w = torch.autograd.grad(cross_entropy_sum(F.linear(hidden, weight) + u @ b.t(), labels),
                                 weight)[0]  # fmt: skip
    assert torch.allclose(got_w, want_w, atol=1e-5, rtol=0)


def adapted_model(dropout: float):
    from titanlab.data.digit_tasks import VOCAB_SIZE
    from titanlab.models.registry import build_model, get_family, get_flavor

    args = dataclasses.replace(get_flavor(get_family("llama3"), "debugmodel_tiny"),
                               vocab_size=VOCAB_SIZE, max_seq_len=32)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    apply_lora(model, Peft(method="lora", rank=4, alpha=8.0, dropout=dropout,
                           target_modules=["wq", "output"]))  # fmt: skip
    init_adapters([model], seed=3)
    with torch.no_grad():  # B starts at 0: give it values, so the adapter changes the logits
        for m in adapted_modules(model):
            m.lora_b.weight.normal_(0, 0.05)
    return model, VOCAB_SIZE


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_model_with_an_adapted_head_trains_the_same_fused(dropout):
    model, vocab = adapted_model(dropout)
    tokens = torch.randint(0, vocab, (2, 12))
    labels = torch.randint(0, vocab, (2, 12))
    labels[0, :3] = -100
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert {"output.lora_a.weight", "output.lora_b.weight"} <= set(trained)
    torch.manual_seed(7)  # the dropout seed of the forward
    want = cross_entropy_sum(model(tokens), labels)
    want_grads = torch.autograd.grad(want, list(trained.values()))
    names = [n for n, _ in model.named_parameters()]
    use_fused_loss(model, chunk_size=5)
    head = model.output
    assert isinstance(head, FusedLossHead) and head.lora_b is not None
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints and exports unchanged
    torch.manual_seed(7)
    with fused_targets(model, labels):
        got = model(tokens)
    got_grads = torch.autograd.grad(got, list(trained.values()))
    assert abs(got.item() - want.item()) < 1e-4
    for name, w, g in zip(trained, want_grads, got_grads):
        assert torch.allclose(g, w, atol=1e-5, rtol=0), name
    torch.manual_seed(7)
    assert torch.allclose(model(tokens), _logits_of(adapted_model(dropout)[0], tokens), atol=1e-6)


def _logits_of(model, tokens):
    torch.manual_seed(7)
    return model(tokens)


def test_disabling_the_adapters_gives_the_base_heads_loss():
    model, vocab = adapted_model(0.0)
    tokens, labels = torch.randint(0, vocab, (2, 12)), torch.randint(0, vocab, (2, 12))
    with adapters_disabled(model):
        want = cross_entropy_sum(model(tokens), labels)
    use_fused_loss(model, chunk_size=4)
    with adapters_disabled(model), fused_targets(model, labels):
        base = model(tokens)
    with fused_targets(model, labels):
        adapted = model(tokens)
    assert torch.allclose(base, want, atol=1e-4, rtol=0)
    assert abs(adapted.item() - base.item()) > 1e-3  # the adapter is on again after
