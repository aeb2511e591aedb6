"""The pure parts of tools/benchmark.py: metrics.jsonl → step times, summaries, table, doc blocks.

No training runs here; the tool itself is smoke-tested by hand (`--matrix quick`).
"""

from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
from tools import benchmark  # noqa: E402
from tools.benchmark import Result, Run  # noqa: E402


def records(step_seconds: list[float], tokens: int) -> list[dict]:
    """metrics.jsonl records as the trainer writes them with log_freq 1 (tps = tokens / dt)."""
    return [
        {
            "step": i + 1,
            "loss": 5.0,
            "grad_norm": 1.0,
            "lr": 1e-3,
            "tps": tokens / dt,
            "memory_gib": 0.5 + i,
        }
        for i, dt in enumerate(step_seconds)
    ]


def test_step_times_drop_warmup_and_invert_tps():
    times = benchmark.step_times(records([9.0, 0.5, 0.25, 0.75], 4096), 4096, warmup=1)
    assert times == pytest.approx([0.5, 0.25, 0.75], rel=1e-15)


def test_step_times_last_record_of_a_step_wins():
    recs = records([1.0, 2.0], 100) + [{"step": 2, "tps": 400.0, "memory_gib": 1.0}]
    assert benchmark.step_times(recs, 100, warmup=0) == [1.0, 0.25]


def test_step_times_refuse_missing_steps():
    recs = records([1.0, 1.0, 1.0], 10)
    with pytest.raises(ValueError, match="log_freq 1"):
        benchmark.step_times([recs[0], recs[2]], 10, warmup=0)


def test_summarize_medians():
    res = benchmark.summarize(Run(), [0.5, 0.25, 1.0], 1000, peak_gib=2.0, threads=1)
    assert res.step_s == 0.5 and res.tps == 2000.0 and res.peak_gib == 2.0 and not res.error
    assert benchmark.summarize(Run(), [], 1000, 2.0, 1).error  # no steps after warm-up


def test_ratios_per_thread_and_by_precision():
    base32 = Result(Run(ranks=0), tps=1000.0, threads=2)
    base16 = Result(Run(ranks=0, precision="bf16"), tps=500.0, threads=2)
    one = Result(Run(ranks=1), tps=900.0, threads=2)
    two = Result(Run(ranks=2), tps=450.0, threads=1)
    bf16_compiled = Result(Run(compile=True, precision="bf16"), tps=750.0, threads=2)
    failed = Result(Run(ac="full"), error="boom")
    tuned = Result(Run(ranks=0, fixed_malloc=True), tps=1100.0, threads=2)  # not the reference
    rows = [one, two, bf16_compiled, failed, tuned, base32, base16]
    benchmark.add_ratios(rows)
    assert one.ratio == pytest.approx(0.9) and two.ratio == pytest.approx(0.9)
    assert tuned.ratio == pytest.approx(1.1)
    assert bf16_compiled.ratio == pytest.approx(1.5)  # falls back to the eager bf16 baseline
    assert failed.ratio is None and base32.ratio == 1.0
    benchmark.add_ratios(rows, per_thread=False)
    assert two.ratio == pytest.approx(0.45)


def test_render_table():
    ok = Result(
        Run(ranks=2, ac="selective"),
        step_s=0.1234,
        tps=16600.4,
        peak_gib=1.5,
        threads=1,
        ratio=0.75,
    )
    bad = Result(Run(compile=True, ranks=1), error="exit 1: RuntimeError: a|b")
    lines = benchmark.render_table([ok, bad]).splitlines()
    assert lines[0] == (
        "| run | step time (ms, median) | tps/rank (median) | peak memory (GiB) | vs baseline |"
    )
    assert lines[1] == "|---|---|---|---|---|"
    assert lines[2] == (
        "| titanlab · eager · AC selective · 2 ranks FSDP · fp32 | 123.4 | 16,600 | 1.50 | 0.75× |"
    )
    assert lines[3] == (
        "| titanlab · compile · AC none · 1 rank · fp32 | failed: exit 1: "
        "RuntimeError: a/b |  |  |  |"
    )
    mfu = Result(
        Run(ranks=0, precision="float8", compile=True),
        step_s=1.0,
        tps=8192.0,
        peak_gib=60.0,
        mfu=0.4321,
    )
    table = benchmark.render_table([mfu], mfu=True).splitlines()
    assert table[0].endswith("| MFU |") and table[1].count("---") == 6
    assert (
        table[2]
        == "| baseline (plain loop) · compile · float8 | 1000.0 | 8,192 | 60.00 |  | 43.2% |"
    )


def test_replace_block_keeps_the_rest(tmp_path):
    text = (
        "# Perf\n\nintro\n\n<!-- benchmark:cpu:begin -->\nold\n<!-- benchmark:cpu:end -->\n\n"
        "<!-- benchmark:cuda:begin -->\ngpu\n<!-- benchmark:cuda:end -->\ntail\n"
    )
    out = benchmark.replace_block(text, "cpu", "new\ntable")
    assert out == text.replace("old", "new\ntable")
    added = benchmark.replace_block("# Perf\n", "cuda-8b", "x")
    assert (
        added == "# Perf\n\n<!-- benchmark:cuda-8b:begin -->\nx\n<!-- benchmark:cuda-8b:end -->\n"
    )

    path = str(tmp_path / "docs" / "performance.md")
    benchmark.write_block(path, "cpu", "first")
    benchmark.write_block(path, "cpu", "second")
    with open(path, encoding="utf-8") as f:
        written = f.read()
    assert written.startswith(benchmark.HEADER) and "second" in written and "first" not in written
    assert written.count("<!-- benchmark:cpu:begin -->") == 1


def test_matrix():
    quick = benchmark.matrix("quick")
    assert [(r.compile, r.ac, r.ranks, r.precision) for r in quick] == [
        (False, "none", 1, "fp32"),
        (False, "none", 2, "fp32"),
        (False, "none", 0, "fp32"),
    ]
    full = benchmark.matrix("full")
    trainer = [r for r in full if r.ranks]
    assert len(trainer) == len(set(trainer)) == 2 * 3 * 2 * 2 and len(full) - len(trainer) == 4
    # every precision and compile mode: titanlab, the plain loop, the plain loop with titanlab's
    # malloc thresholds, side by side so repeats interleave them
    overhead = benchmark.matrix("overhead")
    assert [(r.ranks, r.fixed_malloc) for r in overhead] == [(1, False), (0, False), (0, True)] * 4
    assert {(r.precision, r.compile) for r in overhead[::3]} == {
        (p, c) for p in ("fp32", "bf16") for c in (False, True)
    }
    assert all(a.precision == b.precision == c.precision and a.compile == b.compile == c.compile
               for a, b, c in zip(overhead[::3], overhead[1::3], overhead[2::3]))  # fmt: skip
    with pytest.raises(ValueError, match="quick"):
        benchmark.matrix("huge")


def test_combine_repeats_takes_medians_and_range():
    run = benchmark.Run()
    rows = [
        benchmark.Result(run, step_s=t, tps=4096 / t, peak_gib=g)
        for t, g in ((3.0, 1.0), (2.0, 1.2), (2.5, 1.1))
    ]
    row = benchmark.combine(rows)
    assert (row.step_s, row.tps, row.peak_gib, row.spread) == (2.5, 4096 / 2.5, 1.2, (2.0, 3.0))
    assert "2500.0 (2000–3000)" in benchmark.render_table([row])
    failed = benchmark.Result(run, error="boom")
    assert benchmark.combine([failed]).error == "boom"
    assert benchmark.combine([failed, rows[0]]).step_s == 3.0


def test_decode_flag_writes_the_decode_rows_into_the_same_file(monkeypatch, tmp_path):
    """--decode runs tools/benchmark_decode.py (a script of its own, in a child) on --out."""
    probe = {"torch": "2.13.0", "gpus": 0, "gpu": "", "data_dir": str(tmp_path), "vocab": 4352}
    monkeypatch.setattr(benchmark, "child", lambda spec, threads: probe)
    decode_calls = []

    def fake_run(cmd, **kwargs):
        decode_calls.append(cmd[1:])
        return benchmark.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    out = str(tmp_path / "perf.md")
    assert benchmark.main(["--matrix", "none", "--out", out]) == 0
    assert decode_calls == []
    assert benchmark.main(["--matrix", "none", "--decode", "--out", out]) == 0
    script = os.path.join(benchmark.REPO, "tools", "benchmark_decode.py")
    assert decode_calls == [[script, "--out", out]]
