"""`titanlab.resilience.nonfinite`: which steps are skipped, when the run stops, what the warning
and the error line say; under float16's loss scaler only the loss counts."""

import logging
import math

import pytest
import torch

from titanlab.resilience.failures import TrainingDiverged
from titanlab.resilience.nonfinite import NonFiniteSteps

NAN, INF = math.nan, math.inf


def decisions(guard: NonFiniteSteps, values: dict[int, tuple[float, float]]) -> dict[int, bool]:
    """{step: skipped} for the steps of `values` ({step: (loss, grad_norm)}) in order; stops
    at the step that raises."""
    return {step: guard.skip(step, *values[step]) for step in sorted(values)}


def test_isolated_non_finite_steps_are_skipped_and_a_finite_step_resets_the_count():
    guard = NonFiniteSteps(2)
    values = {1: (2.0, 1.0), 2: (NAN, NAN), 3: (2.0, INF), 4: (1.9, 0.5), 5: (INF, 1.0),
              6: (NAN, 1.0), 7: (1.8, 0.4)}  # fmt: skip
    assert decisions(guard, values) == {
        1: False, 2: True, 3: True, 4: False, 5: True, 6: True, 7: False,
    }  # fmt: skip
    assert guard.skipped == {2, 3, 5, 6} and guard.in_a_row == 0


def test_the_step_after_the_tolerated_ones_raises_one_line():
    guard = NonFiniteSteps(3)
    assert [guard.skip(s, NAN, NAN) for s in (14, 15, 16)] == [True, True, True]
    with pytest.raises(TrainingDiverged) as e:
        guard.skip(17, NAN, INF)
    assert str(e.value) == (
        "step 17: loss or grad norm non-finite for 4 consecutive steps (14-17; "
        "training.skip_nonfinite_steps=3): loss nan, grad norm inf, stopped before its update"
    )
    assert guard.skipped == {14, 15, 16}  # the stopping step is not among the skipped


def test_zero_stops_at_the_first_non_finite_step():
    guard = NonFiniteSteps(0)
    assert guard.skip(1, 3.0, 2.0) is False
    with pytest.raises(TrainingDiverged) as e:
        guard.skip(2, 3.0, NAN)  # a finite loss with a non-finite gradient norm counts too
    assert str(e.value) == (
        "step 2: loss or grad norm non-finite (training.skip_nonfinite_steps=0): loss 3, "
        "grad norm nan, stopped before its update"
    )


def test_under_the_loss_scaler_only_a_non_finite_loss_counts():
    guard = NonFiniteSteps(0, scaled=True)
    # float16 overflows: the scaler skips these itself and lowers its scale
    assert [guard.skip(s, 5.0, INF) for s in range(1, 6)] == [False] * 5
    assert guard.skip(6, 5.0, NAN) is False and guard.in_a_row == 0
    with pytest.raises(TrainingDiverged, match=r"^step 7: .* loss nan, grad norm inf"):
        guard.skip(7, NAN, INF)


def test_disabled_is_minus_one():
    assert not NonFiniteSteps(-1).enabled
    assert NonFiniteSteps(0).enabled and NonFiniteSteps(3).enabled


def test_read_is_one_transfer_of_both_values():
    loss, norm = torch.tensor(2.5), torch.tensor(float("inf"), dtype=torch.float64)
    assert NonFiniteSteps(1).read(loss, norm) == (2.5, INF)


def test_rank_0_alone_warns_naming_the_step(caplog):
    with caplog.at_level(logging.WARNING, logger="titanlab"):
        NonFiniteSteps(3).skip(9, NAN, 1.5, rank=1)
        assert caplog.messages == []
        NonFiniteSteps(3).skip(9, NAN, 1.5, rank=0)
    assert caplog.messages == [
        "step 9 skipped: loss nan, grad norm 1.5 (non-finite step 1 in a row of at most 3: "
        "training.skip_nonfinite_steps); weights and optimizer state unchanged"
    ]
