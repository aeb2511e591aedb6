"""Parsing the metrics line back and the peak-FLOP/s lookup."""

import pytest
import torch

from titanlab.metrics import device_peak_flops, parse_log_line

LINE = (
    "[rank0]:2025-01-01 12:00:00,000 - titanlab - INFO - step: 12  loss: 3.456789  "
    "grad_norm: 1.2345  lr: 3.000e-03  tps: 12345  tflops: 0.123  mfu: n/a  "
    "memory: 1.23GiB(peak_rss)"
)


def test_parse_metrics_line():
    assert parse_log_line(LINE) == (12, 3.456789)
    assert parse_log_line("step: 1  loss: 10.000000  grad_norm: 2.0") == (1, 10.0)


def test_parse_non_finite_loss():
    step, loss = parse_log_line("step: 3  loss: nan  grad_norm: nan")
    assert step == 3 and loss != loss


@pytest.mark.parametrize(
    "line",
    [
        "validation: step: 100  val_loss: 3.210000",
        "training: steps 1 → 200",
        "checkpoint: saved step-100 in 1.2 s",
        "",
    ],
)
def test_other_lines_are_none(line):
    assert parse_log_line(line) is None


def test_cpu_peak_flops_unknown():
    assert device_peak_flops(torch.device("cpu")) is None


def test_configured_peak_flops_wins():
    assert device_peak_flops(torch.device("cpu"), configured=1.5e14) == 1.5e14


def test_format_line_parses_back_and_names_every_figure():
    from titanlab.metrics.format import format_line

    rec = {
        "step": 7, "loss": 2.5, "grad_norm": 0.75, "lr": 1e-3, "tps": 1234.4, "tflops": 0.5,
        "memory_gib": 1.5, "step_time_ms": 12.0, "step_time_ms_min": 10.0,
        "step_time_ms_max": 14.0, "data_wait_ms": 0.5, "cpu_util_pct": 97.0,
        "loss_scale": 65536.0, "alloc_retries": 2.0, "mfu_pct": 41.234,
    }  # fmt: skip
    line = format_line(rec, "peak_reserved")
    assert parse_log_line(line) == (7, 2.5)
    for text in ("tps: 1234", "mfu: 41.23%", "memory: 1.50GiB(peak_reserved)",
                 "step_ms: 12.0 (10.0–14.0)", "data_ms: 0.5", "cpu: 97%",
                 "loss_scale: 65536", "alloc_retries: 2"):  # fmt: skip
        assert text in line, (text, line)
    del rec["mfu_pct"], rec["loss_scale"]
    rec["alloc_retries"] = 0.0
    line = format_line(rec, "peak_rss")
    assert "mfu: n/a" in line and "loss_scale" not in line and "alloc_retries" not in line
