"""The chunked fused distillation loss: loss and student gradients equal
`distillation_loss_sum` on the full logits of student and teacher, for any chunk size,
alpha and temperature, ignored labels included; through models, the teacher's hidden states
and head give the same loss as its logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titanlab.components.fused_ce import linear_distillation_loss_sum
from titanlab.components.fused_head import fused_distillation, teacher_hidden, use_fused_loss
from titanlab.posttrain.distill import distillation_loss_sum


def case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 37, 16, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(50, 16, generator=g)).requires_grad_()
    t_hidden = torch.randn(3, 37, 24, generator=g)
    t_weight = 0.3 * torch.randn(50, 24, generator=g)
    labels = torch.randint(0, 50, (3, 37), generator=g)
    labels[0, :5] = -100
    labels[2, -1] = -100
    return hidden, weight, t_hidden, t_weight, labels


@pytest.mark.parametrize(("chunk_size", "alpha", "temperature"),
                         [(1, 0.5, 2.0), (7, 0.0, 1.0), (64, 1.0, 3.0), (111, 0.3, 0.7)])  # fmt: skip
def test_loss_and_gradients_equal_the_full_logits(chunk_size, alpha, temperature):
    hidden, weight, t_hidden, t_weight, labels = case()
    want = distillation_loss_sum(F.linear(hidden, weight), F.linear(t_hidden, t_weight), labels,
                                 alpha=alpha, temperature=temperature)  # fmt: skip
    want_h, want_w = torch.autograd.grad(1.5 * want, (hidden, weight))
    got = linear_distillation_loss_sum(hidden, weight, t_hidden, t_weight, labels, alpha=alpha,
                                       temperature=temperature, chunk_size=chunk_size)  # fmt: skip
    got_h, got_w = torch.autograd.grad(1.5 * got, (hidden, weight))
    tokens = (labels != -100).sum()
    assert abs(got.item() - want.item()) / tokens < 1e-6  # the mean loss within 1e-6
    assert torch.allclose(got_h, want_h, atol=1e-5, rtol=0)
    assert torch.allclose(got_w, want_w, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="chunk_size=0 must be > 0"):
        linear_distillation_loss_sum(hidden, weight, t_hidden, t_weight, labels, alpha=alpha,
                                     temperature=temperature, chunk_size=0)  # fmt: skip


def test_through_models_the_teachers_hidden_states_give_its_logits_loss():
    from titanlab.data.digit_tasks import VOCAB_SIZE
    from titanlab.models.registry import build_model, get_family, get_flavor

    def tiny(flavor: str, seed: int):
        args = dataclasses.replace(get_flavor(get_family("llama3"), flavor),
                                   vocab_size=VOCAB_SIZE, max_seq_len=32)  # fmt: skip
        torch.manual_seed(seed)
        model = build_model(args)
        model.init_weights()
        return model

    student, teacher = tiny("debugmodel_tiny", 0), tiny("debugmodel", 1)
    tokens = torch.randint(0, VOCAB_SIZE, (2, 12))
    labels = torch.randint(0, VOCAB_SIZE, (2, 12))
    with torch.no_grad():
        t_logits = teacher(tokens)
    want = distillation_loss_sum(student(tokens), t_logits, labels, alpha=0.4, temperature=2.0)
    want_grads = torch.autograd.grad(want, list(student.parameters()))
    use_fused_loss(student, chunk_size=5)
    use_fused_loss(teacher, chunk_size=5)
    with torch.no_grad():
        held = teacher_hidden(teacher, tokens)
    assert held[0].shape == (2, 12, teacher.output.in_features)
    with fused_distillation(student, labels, held, alpha=0.4, temperature=2.0):
        got = student(tokens)
    got_grads = torch.autograd.grad(got, list(student.parameters()))
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    for g, w in zip(got_grads, want_grads):
        assert torch.allclose(g, w, atol=1e-5, rtol=0)
    assert teacher(tokens).shape == student(tokens).shape == (2, 12, VOCAB_SIZE)  # logits again
