"""lr_factor's schedule shapes, the LambdaLR/AdamW built from config, and the three AdamW kernels."""

import math

import pytest
import torch

from titanlab.config.job_config import LRScheduler, Optimizer
from titanlab.components.optim import build_lr_scheduler, build_optimizer, lr_factor

CPU = torch.device("cpu")


def factor(step, *, warmup=10, total=110, ratio=-1.0, kind="linear", min_lr=0.0):
    return lr_factor(
        step,
        warmup_steps=warmup,
        total_steps=total,
        decay_ratio=ratio,
        decay_type=kind,
        min_lr_factor=min_lr,
    )


def tiny_linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def make_optimizer(model, **overrides):
    return build_optimizer(model, Optimizer(**overrides), CPU)


def train_steps(model, optimizer, scheduler=None, steps=3):
    """A few deterministic AdamW steps on a fixed regression problem."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


# --- lr_factor ----------------------------------------------------------------------------------
def test_warmup_ramps_linearly():
    w = 10
    assert factor(0, warmup=w) == pytest.approx(1 / 11)
    for step in range(w):
        assert factor(step, warmup=w) == pytest.approx((step + 1) / (w + 1))
    assert factor(w - 1, warmup=w) == pytest.approx(10 / 11)


def test_peak_at_end_of_warmup():
    assert factor(10, warmup=10) == 1.0
    assert factor(0, warmup=0) == 1.0


def progress(step, warmup=10, total=110):
    """Fraction of the decay done at `step`: the first decay step is 0, the last (total-1) is 1."""
    return (step - warmup) / (total - warmup - 1)


@pytest.mark.parametrize("min_lr", [0.0, 0.1])
def test_linear_decay_reaches_min_at_last_step(min_lr):
    # total 110, warmup 10: decays over the 100 steps after warmup (steps 10..109).
    assert factor(59, min_lr=min_lr) == pytest.approx(min_lr + (1 - min_lr) * (1 - progress(59)))
    assert factor(109, min_lr=min_lr) == pytest.approx(min_lr)  # the last optimizer step
    assert factor(500, min_lr=min_lr) == pytest.approx(min_lr)  # clamped past the end


def test_linear_decay_is_monotone():
    values = [factor(s) for s in range(10, 110)]
    assert all(a > b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("min_lr", [0.0, 0.1, 0.5])
def test_cosine_shape(min_lr):
    assert factor(10, kind="cosine", min_lr=min_lr) == pytest.approx(1.0)
    assert factor(109, kind="cosine", min_lr=min_lr) == pytest.approx(min_lr)
    for step in (35, 59, 80):
        expected = min_lr + (1 - min_lr) * 0.5 * (1 + math.cos(math.pi * progress(step)))
        assert factor(step, kind="cosine", min_lr=min_lr) == pytest.approx(expected)


def test_wsd_stable_then_decay():
    # 100 post-warmup steps, decay_ratio 0.2: stable through step 90, then 20 decay steps 90..109.
    wsd = [factor(s, ratio=0.2, min_lr=0.1) for s in range(111)]
    assert all(v == 1.0 for v in wsd[10:91])
    assert wsd[95] == pytest.approx(0.1 + 0.9 * (1 - 5 / 19))
    assert wsd[100] == pytest.approx(0.1 + 0.9 * (1 - 10 / 19))
    assert wsd[109] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(wsd[90:110], wsd[91:110]))


def test_wsd_zero_ratio_never_decays():
    assert [factor(s, ratio=0.0) for s in (10, 60, 109, 110)] == [1.0] * 4


@pytest.mark.parametrize("step, shape", [(10, 1.0), (34, 1 - math.sqrt(24 / 99)), (109, 0.0)])
def test_sqrt_shape(step, shape):
    assert factor(step, kind="sqrt", min_lr=0.2) == pytest.approx(0.2 + 0.8 * shape)


def test_unknown_decay_type_is_one_line():
    with pytest.raises(ValueError) as info:
        factor(50, kind="exp")
    assert str(info.value) == "lr_scheduler.decay_type='exp'; valid: linear, cosine, sqrt"


# --- build_lr_scheduler + build_optimizer ------------------------------------------------------
def scheduler_cfg():
    return LRScheduler(warmup_steps=3, decay_ratio=-1.0, decay_type="cosine", min_lr_factor=0.1)


def expected_lr(k, lr=0.01, total=10):
    cfg = scheduler_cfg()
    return lr * lr_factor(
        k,
        warmup_steps=cfg.warmup_steps,
        total_steps=total,
        decay_ratio=cfg.decay_ratio,
        decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )


@pytest.mark.parametrize("k", [0, 1, 3, 6, 10])
def test_scheduler_sets_lr_times_factor(k):
    model = tiny_linear()
    optimizer = make_optimizer(model, lr=0.01, implementation="for-loop")
    scheduler = build_lr_scheduler(optimizer, scheduler_cfg(), total_steps=10)
    train_steps(model, optimizer, scheduler, steps=k)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr(k), rel=1e-12)
    assert scheduler.get_last_lr()[0] == pytest.approx(expected_lr(k), rel=1e-12)


def test_scheduler_state_dict_round_trip():
    model = tiny_linear()
    optimizer = make_optimizer(model, lr=0.01, implementation="for-loop")
    scheduler = build_lr_scheduler(optimizer, scheduler_cfg(), total_steps=10)
    train_steps(model, optimizer, scheduler, steps=5)
    state = scheduler.state_dict()

    resumed_opt = make_optimizer(tiny_linear(), lr=0.01, implementation="for-loop")
    resumed = build_lr_scheduler(resumed_opt, scheduler_cfg(), total_steps=10)
    assert resumed_opt.param_groups[0]["lr"] == pytest.approx(expected_lr(0))
    resumed.load_state_dict(state)
    assert resumed.last_epoch == 5
    assert resumed.get_last_lr()[0] == pytest.approx(expected_lr(5), rel=1e-12)
    resumed.step()
    assert resumed_opt.param_groups[0]["lr"] == pytest.approx(expected_lr(6), rel=1e-12)


def test_optimizer_hyperparameters_from_config():
    optimizer = make_optimizer(
        tiny_linear(),
        lr=0.02,
        beta1=0.8,
        beta2=0.99,
        eps=1e-6,
        weight_decay=0.05,
        implementation="foreach",
    )
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        0.02,
        (0.8, 0.99),
        1e-6,
        0.05,
    )
    assert group["foreach"] is True


@pytest.mark.parametrize(
    "impl, fused, foreach",
    [("fused", True, None), ("foreach", None, True), ("for-loop", None, False)],
)
def test_implementation_flags(impl, fused, foreach):
    group = make_optimizer(tiny_linear(), implementation=impl).param_groups[0]
    assert (group["fused"], group["foreach"]) == (fused, foreach)


def test_implementations_give_identical_updates():
    results = {}
    for impl in ("fused", "foreach", "for-loop"):
        model = tiny_linear(seed=3)
        optimizer = make_optimizer(model, lr=0.05, weight_decay=0.1, implementation=impl)
        train_steps(model, optimizer, steps=4)
        results[impl] = [p.detach().clone() for p in model.parameters()]
    initial = list(tiny_linear(seed=3).parameters())
    assert not torch.allclose(results["for-loop"][0], initial[0])  # the steps moved the weights
    for impl in ("fused", "foreach"):
        for got, ref in zip(results[impl], results["for-loop"]):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
