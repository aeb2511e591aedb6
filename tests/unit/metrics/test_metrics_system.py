"""CPU utilization tracks busy vs idle; CPU memory figures are consistent."""

import time

import torch

from titanlab.metrics.system import CpuMeter, memory_fields, memory_kind


def test_cpu_meter_sees_busy_and_idle():
    meter = CpuMeter()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass
    busy = meter.percent()
    time.sleep(0.3)
    idle = meter.percent()
    assert busy > idle >= 0 and idle < 30


def test_cpu_memory_fields():
    f = memory_fields(torch.device("cpu"))
    assert set(f) == {"rss_gib", "rss_peak_gib", "memory_gib"}
    assert f["rss_peak_gib"] >= f["rss_gib"] > 0.01 and f["memory_gib"] == f["rss_peak_gib"]
    assert memory_kind(torch.device("cpu")) == "peak_rss"
