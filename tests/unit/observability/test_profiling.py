"""StepProfiler on CPU: the windows it writes, the trace's content and the memory peak."""

import glob
import gzip
import json
import os

import pytest
import torch

from titanlab.config.job_config import ConfigError
from titanlab.config.profiling import Profiling
from titanlab.observability.profiling import StepProfiler, live_tensor_bytes

MB = 1_000_000


def run_steps(tmp_path, cfg: Profiling, steps: int, first_step: int = 1) -> None:
    """`steps` steps; each allocates a 4 MB and an 8 MB tensor, both alive at once, then frees
    them: the window's peak of new tensors is 12 MB (plus the scalars of the sum)."""
    with StepProfiler(cfg, str(tmp_path), rank=0, device=torch.device("cpu")) as prof:
        for step in range(first_step, first_step + steps):
            a = torch.ones(MB)  # 4 MB of float32
            b = torch.ones(2 * MB)  # 8 MB
            (a.sum() + b.sum()).item()
            del a, b
            prof.step(step)


def test_profile_freq_must_hold_warmup_and_active():
    with pytest.raises(ConfigError, match=r"profiling.profile_freq=3 must be >= .* = 4"):
        Profiling(profile_freq=3, profiler_warmup=2, profiler_active=2).validate()
    with pytest.raises(ConfigError, match="profiler_active=0"):
        Profiling(profiler_active=0).validate()


def test_one_trace_per_window_named_by_the_training_step(tmp_path):
    cfg = Profiling(enable_profiling=True, profile_freq=3, profiler_warmup=1, profiler_active=1)
    run_steps(tmp_path, cfg, steps=7, first_step=11)  # a resumed run: steps 11..17
    # Windows end on the 3rd and 6th step of this run: training steps 13 and 16; the partial
    # window at step 17 is dropped.
    folders = sorted(os.listdir(tmp_path / "profile_traces"))
    assert folders == ["step-13", "step-16"]
    with open(tmp_path / "profile_traces" / "step-16" / "rank0_trace.json") as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    assert "aten::ones" in names and "aten::sum" in names
    assert not (tmp_path / "memory_snapshot").exists()


def test_cpu_memory_timeline_peak_is_the_windows_live_tensors(tmp_path):
    cfg = Profiling(enable_memory_snapshot=True, profile_freq=2, profiler_warmup=0)
    run_steps(tmp_path, cfg, steps=4)
    peaks = sorted(glob.glob(str(tmp_path / "memory_snapshot" / "rank0_step*_peak.json")))
    assert [os.path.basename(p) for p in peaks] == [
        "rank0_step2_peak.json",
        "rank0_step4_peak.json",
    ]
    for path in peaks:
        with open(path) as f:
            peak = json.load(f)
        # 12 MB of the two tensors plus at most a few scalars (the sums: 4 bytes each).
        assert 12 * MB <= peak["window_peak_bytes"] <= 12 * MB + 64
        # The categorized peak counts the same tensors (nothing existed before: no parameters).
        assert 12 * MB <= peak["peak_bytes"] <= 12 * MB + 64
    series = tmp_path / "memory_snapshot" / "rank0_step2.json.gz"
    if not series.exists():  # matplotlib installed: the HTML plot instead
        assert (tmp_path / "memory_snapshot" / "rank0_step2.html").exists()
    else:
        with gzip.open(series, "rt") as f:
            times, sizes = json.load(f)
        assert len(times) == len(sizes) > 0


def test_cpu_peak_live_bytes_counts_the_tensors_from_before_the_window(tmp_path):
    """A 4 MB tensor that lives through every step (like a parameter) and an 8 MB one freed in
    the first recorded step (like last step's gradients) before the 12 MB of the step are
    allocated: the peak of every live tensor is 4 + 12 MB, the window's own peak 12 MB."""
    cfg = Profiling(enable_memory_snapshot=True, profile_freq=2, profiler_warmup=0)
    # Tensors that earlier tests in this worker left alive (module caches, fixtures) count too:
    # the assertions are about what this test adds on top of them.
    base = live_tensor_bytes()
    keep = torch.ones(MB)
    view = keep[: MB // 2]  # a view: its storage is counted once
    old = [torch.ones(2 * MB)]
    with StepProfiler(cfg, str(tmp_path), rank=0, device=torch.device("cpu")) as prof:
        for step in (1, 2):
            if step == 2:
                old.clear()
            a, b = torch.ones(MB), torch.ones(2 * MB)
            (a.sum() + b.sum() + view.sum()).item()
            del a, b
            prof.step(step)
    with open(tmp_path / "memory_snapshot" / "rank0_step2_peak.json") as f:
        peak = json.load(f)
    assert 12 * MB <= peak["live_at_window_start_bytes"] - base <= 12 * MB + 4096
    assert 16 * MB <= peak["peak_live_bytes"] - base <= 16 * MB + 4096
    assert 12 * MB <= peak["window_peak_bytes"] <= 12 * MB + 64
