"""The training loss function: compiled on request, eager under loss parallel."""

import torch

from titanlab.components.loss import build_loss_fn, cross_entropy_sum


def test_compiled_loss_equals_eager():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 32, (2, 8), generator=g)
    labels[0, 0] = -100  # ignored position
    compiled = build_loss_fn(compile_loss=True, loss_parallel=False)
    assert compiled is not cross_entropy_sum
    eager_loss = cross_entropy_sum(logits, labels)
    (eager_grad,) = torch.autograd.grad(eager_loss, logits)
    loss = compiled(logits, labels)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.allclose(loss, eager_loss, atol=1e-5, rtol=0)
    assert torch.allclose(grad, eager_grad, atol=1e-6, rtol=0)


def test_loss_stays_eager_under_loss_parallel_or_without_compile():
    assert build_loss_fn(compile_loss=True, loss_parallel=True) is cross_entropy_sum
    assert build_loss_fn(compile_loss=False, loss_parallel=False) is cross_entropy_sum
