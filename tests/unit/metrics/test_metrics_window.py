"""The step window: device values stay pending until fetched, in one transfer, in step order."""

import math

import torch

from titanlab.metrics.window import StepRecord, StepWindow, spread


def record(step: int, loss: float, **extra: float) -> StepRecord:
    pending = {"loss": torch.tensor(loss), "grad_norm": torch.tensor(step * 0.5)}
    pending.update({k: torch.tensor(v) for k, v in extra.items()})
    return StepRecord(step, 0.1, 0.01, 1e-3, None, pending=pending)


def test_fetch_brings_every_pending_value_once_with_one_stack(monkeypatch):
    w = StepWindow()
    for s in (1, 2, 3):
        w.add(record(s, 10.0 - s, **{"moe/aux_loss": s / 10}))
    stacks = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: stacks.append(1) or real_stack(*a, **k))
    fetched = w.fetch()
    assert len(stacks) == 1
    assert [r.step for r in fetched] == [1, 2, 3]
    for r in fetched:
        assert r.pending == {}
        assert r.values["loss"] == 10.0 - r.step
        assert r.values["grad_norm"] == r.step * 0.5
        assert math.isclose(r.values["moe/aux_loss"], r.step / 10, rel_tol=1e-6)
    assert w.fetch() == []  # nothing left pending


def test_first_non_finite_names_the_earliest_bad_step():
    w = StepWindow()
    for s, loss in ((1, 3.0), (2, float("nan")), (3, float("inf"))):
        w.add(record(s, loss))
    assert w.first_non_finite() is None  # not fetched yet: unknown
    w.fetch()
    bad = w.first_non_finite()
    assert bad is not None and bad.step == 2


def test_spread():
    assert spread([1.0, 3.0, 2.0], 1000) == (2000.0, 1000.0, 3000.0)
    assert all(math.isnan(x) for x in spread([]))
