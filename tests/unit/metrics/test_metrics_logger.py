"""The metrics record: throughput, step-time spread and memory from a controlled clock."""

import math

import pytest
import torch

from titanlab.metrics import logger as logger_mod
from titanlab.metrics.logger import MetricsLogger


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Capture:
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.closed = False

    def write(self, rec: dict) -> None:
        self.records.append(rec)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(logger_mod.time, "perf_counter", c)
    return c


def run_step(m: MetricsLogger, clock: Clock, step: int, data_s: float, compute_s: float,
             loss: float, fetch: bool, **extra):  # fmt: skip
    m.begin_step()
    clock.t += data_s
    m.data_ready()
    clock.t += compute_s
    return m.end_step(
        step,
        loss=torch.tensor(loss),
        grad_norm=torch.tensor(1.5),
        lr=0.01 * step,
        extra={k: torch.tensor(v) for k, v in extra.items()},
        fetch=fetch,
    )


def make(peak: float | None = None, rank: int = 0) -> tuple[MetricsLogger, Capture]:
    sink = Capture()
    m = MetricsLogger(
        device=torch.device("cpu"), rank=rank, log_freq=3, tokens_per_step=4096,
        samples_per_step=32, world_size=4, flops_per_token=1000, peak_flops=peak, sinks=[sink],
    )  # fmt: skip
    return m, sink


def test_window_record_is_consistent(clock):
    m, sink = make(peak=1e9)
    times = [(0.01, 0.19), (0.02, 0.28), (0.03, 0.47)]  # step times 0.2, 0.3, 0.5 s
    for step, (d, c) in enumerate(times, start=1):
        assert run_step(m, clock, step, d, c, 5.0 - step, fetch=step == 3, **{"moe/x": 2.0}) is None
    rec = m.log(3, val_loss=2.0)
    assert sink.records == [rec]
    assert rec["step"] == 3 and rec["loss"] == 2.0 and rec["lr"] == pytest.approx(0.03)
    assert rec["steps_in_window"] == 3
    assert rec["step_time_ms"] == pytest.approx(1000 / 3)
    assert (rec["step_time_ms_min"], rec["step_time_ms_max"]) == pytest.approx((200, 500))
    assert rec["data_wait_ms"] == pytest.approx(20)
    assert (rec["data_wait_ms_min"], rec["data_wait_ms_max"]) == pytest.approx((10, 30))
    # tokens/s × mean step time = tokens per step; per rank = total ÷ world size.
    assert rec["tps_total"] * rec["step_time_ms"] / 1000 == pytest.approx(4096)
    assert rec["tps"] == pytest.approx(rec["tps_total"] / 4)
    assert rec["samples_per_s_total"] * rec["step_time_ms"] / 1000 == pytest.approx(32)
    assert rec["samples_per_s"] == pytest.approx(rec["samples_per_s_total"] / 4)
    assert rec["tflops"] == pytest.approx(rec["tps"] * 1000 / 1e12)
    assert rec["mfu_pct"] == pytest.approx(100 * rec["tps"] * 1000 / 1e9)
    assert rec["val_loss"] == 2.0 and rec["val_ppl"] == pytest.approx(math.e**2)
    assert rec["moe/x"] == 2.0
    assert rec["rss_peak_gib"] >= rec["rss_gib"] > 0 and rec["memory_gib"] == rec["rss_peak_gib"]
    assert all(math.isfinite(v) for v in rec.values() if isinstance(v, float))
    assert len(m.window) == 0 and m.run_steps == 3
    assert m.mean_tps() == pytest.approx(rec["tps"])
    m.close()
    assert sink.closed


def test_non_logging_steps_stay_pending_and_divergence_names_the_first_bad_step(clock):
    m, _ = make()
    run_step(m, clock, 1, 0.0, 0.1, 3.0, fetch=False)
    run_step(m, clock, 2, 0.0, 0.1, float("nan"), fetch=False)
    assert all(r.pending for r in m.window.records)
    bad = run_step(m, clock, 3, 0.0, 0.1, 4.0, fetch=True)
    assert bad is not None and bad.step == 2 and math.isnan(bad.values["loss"])


def test_only_rank_zero_writes_and_mfu_is_omitted_without_a_peak(clock):
    m, sink = make(peak=None, rank=1)
    run_step(m, clock, 1, 0.0, 0.1, 3.0, fetch=True)
    rec = m.log(1)
    assert sink.records == [] and "mfu_pct" not in rec and "val_loss" not in rec


def test_log_needs_the_fetched_window(clock):
    m, _ = make()
    run_step(m, clock, 1, 0.0, 0.1, 3.0, fetch=False)
    with pytest.raises(AssertionError):
        m.log(1)
