"""The chunked fused linear + cross-entropy: the loss and both gradients equal the unfused head +
cross-entropy for any chunk size, ignored labels included; a frozen head gets no gradient; the
fused head of a model returns logits outside `fused_targets` and the loss inside."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titanlab.components.fused_ce import (
    _compiled_chunk,
    linear_cross_entropy_sum,
    lora_linear_cross_entropy_sum,
)
from titanlab.components.fused_head import FusedLossHead, fused_targets, use_fused_loss
from titanlab.components.loss import cross_entropy_sum


def case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 37, 16, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(50, 16, generator=g)).requires_grad_()
    labels = torch.randint(0, 50, (3, 37), generator=g)
    labels[0, :5] = -100
    labels[2, -1] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 111, 4096])
def test_loss_and_gradients_equal_the_unfused_head(chunk_size):
    hidden, weight, labels = case()
    want = cross_entropy_sum(F.linear(hidden, weight), labels)
    want_h, want_w = torch.autograd.grad(2.5 * want, (hidden, weight))
    got = linear_cross_entropy_sum(hidden, weight, labels, chunk_size)
    got_h, got_w = torch.autograd.grad(2.5 * got, (hidden, weight))
    tokens = (labels != -100).sum()
    assert abs(got.item() - want.item()) / tokens < 1e-6  # the mean loss within 1e-6
    assert torch.allclose(got_h, want_h, atol=1e-5, rtol=0)
    assert torch.allclose(got_w, want_w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size", [7, 4096])
def test_compiled_chunks_give_the_unfused_loss_and_gradients(chunk_size):
    # 111 tokens: chunks of 7 end in a shorter one (a second, dynamic-shape graph)
    hidden, weight, labels = case(2)
    want = cross_entropy_sum(F.linear(hidden, weight), labels)
    want_h, want_w = torch.autograd.grad(2.5 * want, (hidden, weight))
    eager = linear_cross_entropy_sum(hidden, weight, labels, chunk_size)
    got = linear_cross_entropy_sum(hidden, weight, labels, chunk_size, compiled=True)
    got_h, got_w = torch.autograd.grad(2.5 * got, (hidden, weight))
    assert _compiled_chunk.cache_info().currsize == 1  # the compiled function ran
    tokens = (labels != -100).sum()
    assert abs(got.item() - want.item()) / tokens < 1e-6
    assert abs(got.item() - eager.item()) / tokens < 1e-6
    assert torch.allclose(got_h, want_h, atol=1e-5, rtol=0)
    assert torch.allclose(got_w, want_w, atol=1e-5, rtol=0)
    u = torch.randn(3, 37, 4, generator=torch.Generator().manual_seed(3), requires_grad=True)
    b = torch.randn(50, 4, generator=torch.Generator().manual_seed(4), requires_grad=True)
    low = F.linear(hidden, weight) + u @ b.t()
    want_lora = torch.autograd.grad(cross_entropy_sum(low, labels), (hidden, u, b))
    got_lora = torch.autograd.grad(
        lora_linear_cross_entropy_sum(hidden, weight, u, b, labels, chunk_size, compiled=True),
        (hidden, u, b),
    )
    for name, w, g in zip(("hidden", "u", "b"), want_lora, got_lora):
        assert torch.allclose(g, w, atol=1e-5, rtol=0), name


def test_a_frozen_head_and_no_grad_compute_only_what_is_needed():
    hidden, weight, labels = case(1)
    weight.requires_grad_(False)
    got = linear_cross_entropy_sum(hidden, weight, labels, 8)
    (got_h,) = torch.autograd.grad(got, hidden)
    want_h = torch.autograd.grad(cross_entropy_sum(F.linear(hidden, weight), labels), hidden)[0]
    assert torch.allclose(got_h, want_h, atol=1e-5, rtol=0)
    with torch.no_grad():
        loss = linear_cross_entropy_sum(hidden, weight, labels, 8)
    assert not loss.requires_grad and torch.allclose(loss, got.detach())
    with pytest.raises(ValueError, match="chunk_size=0 must be > 0"):
        linear_cross_entropy_sum(hidden, weight, labels, 0)


def test_the_fused_head_returns_logits_or_the_loss_and_keeps_the_weight_name():
    from titanlab.data.digit_tasks import VOCAB_SIZE
    from titanlab.models.registry import build_model, get_family, get_flavor

    args = dataclasses.replace(get_flavor(get_family("llama3"), "debugmodel_tiny"),
                               vocab_size=VOCAB_SIZE, max_seq_len=32)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    names = [n for n, _ in model.named_parameters()]
    tokens = torch.randint(0, VOCAB_SIZE, (2, 12))
    labels = torch.randint(0, VOCAB_SIZE, (2, 12))
    want = cross_entropy_sum(model(tokens), labels)
    use_fused_loss(model, chunk_size=5)
    assert isinstance(model.output, FusedLossHead)
    assert [n for n, _ in model.named_parameters()] == names
    with fused_targets(model, labels):
        got = model(tokens)
    assert got.dim() == 0 and torch.allclose(got, want, atol=1e-4, rtol=0)
    assert model(tokens).shape == (2, 12, VOCAB_SIZE)  # logits again after the context


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_their_gradients_equal_the_full_logits(temperature):
    from titanlab.components.fused_ce import chunked_token_logprobs
    from titanlab.posttrain.rl.objectives import token_logprobs

    hidden, weight, labels = case(2)
    labels = labels.clamp(min=0)
    upstream = torch.randn(labels.shape, generator=torch.Generator().manual_seed(3))
    want = token_logprobs(F.linear(hidden, weight), labels, temperature)
    want_h, want_w = torch.autograd.grad((want * upstream).sum(), (hidden, weight))
    got = chunked_token_logprobs(hidden, weight, labels, temperature, chunk_size=10)
    got_h, got_w = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    assert got.shape == labels.shape and torch.allclose(got, want, atol=1e-5, rtol=0)
    assert torch.allclose(got_h, want_h, atol=1e-5, rtol=0)
    assert torch.allclose(got_w, want_w, atol=1e-5, rtol=0)
