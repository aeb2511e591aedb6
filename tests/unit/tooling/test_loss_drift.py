"""tools/loss_drift.py's summary of two runs' losses step by step."""

from tools.loss_drift import drift


def test_drift_reports_the_early_max_the_first_step_over_1e5_the_worst_and_the_last():
    ref = {s: 5.0 for s in range(1, 31)}
    run = dict(ref)
    run[3] = 5.0 + 2e-6
    run[22] = 5.0 - 3e-5
    run[25] = 5.0 + 4e-4
    run[30] = 5.0 + 1e-6
    d = drift(run, ref)
    assert abs(d["early"] - 2e-6) < 1e-9 and d["first"] == 22
    assert abs(d["max"] - 4e-4) < 1e-9 and d["max_step"] == 25
    assert abs(d["last"] - 1e-6) < 1e-9 and d["last_loss"] == run[30]
    assert drift(ref, ref)["first"] is None
