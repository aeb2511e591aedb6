"""tools/benchmark_host_memory.py and tools.lib.host_memory without a training run: a sample of
this process sees objects kept between two samples (and not the samples' own), the slope is per
1,000 steps, and the table has a row per run, failed runs included."""

import argparse
import collections
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)

from tools import benchmark_host_memory as bench  # noqa: E402
from tools.lib import host_memory as hm  # noqa: E402


def fake(step: int, rss: float, objects: int = 1000, tracing: float = 0.0) -> hm.Sample:
    return hm.Sample(step, rss, rss - 100, 100.0, 10.0, 50.0, 5.0, objects, 10_000, 5_000, math.nan,
                     tracing, 0, collections.Counter())  # fmt: skip


def test_the_slope_is_per_thousand_steps_and_can_leave_out_tracemalloc():
    samples = [fake(s, 400 + 0.014 * s, tracing=0.002 * s) for s in (200, 400, 600, 800)]
    assert hm.per_thousand(samples, "rss_mib") == pytest.approx(14.0)
    assert hm.per_thousand(samples, lambda s: s.rss_mib - s.tracing_mib) == pytest.approx(12.0)
    assert math.isnan(hm.per_thousand(samples[:1], "rss_mib"))


SAMPLED_LOOP = """
import json, sys
from tools.lib import host_memory as hm

kept, history, samples = [], [], []


class Loop:
    step = 0

    def real(self):
        self.step += 1
        kept.append([self.step])  # a list kept per step: the leak the samples must see
        history.append(0.5 * self.step)  # a float: untracked, but its history's length grows


step = hm.sampling_step(Loop.real, (10, 60, 110), samples, full_collect=True)
loop = Loop()
for _ in range(110):
    step(loop)
first, middle, last = samples
print(json.dumps({"steps": [s.step for s in samples],
                  "grown": dict(hm.growth_by_type(first, last)),
                  "grown_late": dict(hm.growth_by_type(middle, last)),
                  "items_late": last.items - middle.items,
                  "rss": last.rss_mib, "anon": last.anon_mib,
                  "blocks": last.blocks - first.blocks}))
"""


def test_samples_see_objects_kept_between_them_and_leave_their_own_out():
    """In a process of its own: a pytest worker's own threads create and free lists too."""
    proc = subprocess.run([sys.executable, "-c", SAMPLED_LOOP], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["steps"] == [10, 60, 110]
    assert got["grown"] == {"builtins.list": 100}
    assert got["grown_late"]["builtins.list"] == 50
    assert got["items_late"] == 150  # kept's items, theirs, and the history's
    assert got["rss"] > 0 and got["anon"] > 0 and got["blocks"] > 0


def test_the_table_has_a_row_per_run_and_names_a_failure():
    a = argparse.Namespace(flavor="debugmodel_tiny", warmup=300, every=50, steps=600,
                           tracemalloc=True)  # fmt: skip
    rows = [
        bench.Row("FSDP 2 · AdamW fused", rss_start=461.2, rss=3.9, data=3.4, heap=0.01,
                  heap_free=-1.4, objects=0.0, top="none", traced=1.05, cache=0.0,
                  trimmed=41.1, step_s=0.16),
        bench.Row("TP 2 · AdamW fused", error="exit 1: RuntimeError: boom"),
    ]  # fmt: skip
    table = bench.render(rows, a, "python tools/benchmark_host_memory.py", {})
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("| run |"))
    assert len(header.split("|")) == len(bench.COLUMNS) + 2
    assert "| FSDP 2 · AdamW fused | 461 | +3.9 | +3.4 | +0.01 | -1.4 | +0 (none) |" in table
    assert "| TP 2 · AdamW fused | exit 1: RuntimeError: boom |" in table
    assert all(line.count("|") == header.count("|") for line in lines if line.startswith("| "))
