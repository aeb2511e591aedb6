"""`clip_grad_norm_` on CPU: the norm accumulates in float64, so it does not depend on how a
gradient is split into shards (torch 2.13's float32 CPU norm of a constant (4352, 64) tensor is
1.5e-5 off; FSDP's halves were off by a different amount, which made the clipped update depend
on the layout)."""

import torch

from titanlab.distributed.utils import clip_grad_norm_


def _params(*grads: torch.Tensor) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def test_norm_is_the_float64_norm_however_the_gradient_is_split():
    g = torch.full((4352, 64), 1e-3)
    exact = g.double().norm().item()
    assert abs(g.norm().item() / exact - 1) > 1e-5  # the float32 norm this guards against
    whole = clip_grad_norm_(_params(g), max_norm=0).item()
    halves = clip_grad_norm_(_params(g[:2176], g[2176:]), max_norm=0).item()
    assert whole == halves
    assert abs(whole / exact - 1) < 1e-7


def test_clipping_scales_to_max_norm():
    params = _params(torch.full((100,), 3.0), torch.full((10, 10), 4.0))
    norm = clip_grad_norm_(params, max_norm=1.0)
    assert abs(norm.item() - 50.0) < 1e-5 and norm.dtype == torch.float32
    clipped = torch.cat([p.grad.flatten() for p in params]).double().norm().item()
    assert abs(clipped - 1.0) < 1e-5


def test_a_large_gradient_norm_is_float64_accurate_without_a_float64_copy():
    g = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = g.double().norm().item()
    assert abs(g.norm().item() / exact - 1) > 1e-6  # float32's error at 16 M terms
    got = clip_grad_norm_(_params(g), max_norm=0).item()
    assert got == torch.tensor(exact, dtype=torch.float32).item()


def test_every_shape_gives_the_float64_norm_rounded_to_float32():
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=gen) for s in ((64, 3000), (3000, 64), (4, 5, 600), (700,))]
    exact = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt().item()
    got = clip_grad_norm_(_params(*grads), max_norm=0).item()
    assert got == torch.tensor(exact, dtype=torch.float32).item()
