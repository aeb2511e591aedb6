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
