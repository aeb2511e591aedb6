"""Check the layout planner against measured runs on this machine (issue 34's CPU check).

    python tools/plan_check.py [--nproc 4] [--steps 8] [--repeats 2] [--out docs/planning.md]

Calibrates a profile of this machine for `--nproc` ranks (`titanlab.plan --calibrate`), ranks
every layout of the debug model that the validator accepts and the memory estimate fits
(`titanlab.planning.planner.plan`), then trains each a few steps on `--nproc` forked ranks:
its step time is the median of steps 3 .. N-1 (metrics.jsonl, log_freq 1), its memory the
largest peak of live tensors over the ranks in step N (`profiling.enable_memory_snapshot`, the
CPU memory timeline), compared with the estimate's `peak_tensors`. With `--repeats R` every
layout is measured R times in interleaved passes (forward order, then reverse, ...), so a
drift of the machine over the tens of minutes falls on every layout alike; its step time is
the mean of its passes' medians, and Spearman's ρ between the passes (the measurement's own
repeatability, the ceiling for any model) is printed beside the model's. Prints and writes
(block `plan-check-cpu` of `--out`) each layout's predicted and measured figures, Spearman's ρ
between the predicted and measured step times, the worst memory error, and how far the
planner's first pick is from the measured best.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.bench import cpu_model, ram_gib, write_block
from tools.lib.runs import launch

JOB = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
       "--training.seq_len", "128", "--training.global_batch_size", "16",
       "--training.local_batch_size", "4"]  # fmt: skip


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties; Pearson's r of the ranks)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def measure(cand, steps: int, dataset: str, workdir: str) -> tuple[float, int] | str:
    """(median step seconds, largest peak of live tensor bytes over the ranks) of a planner
    candidate (its layout and AC mode), or the failure."""
    lay, ac = cand.layout, cand.config.activation_checkpoint
    dump = os.path.join(workdir, f"{lay.name}-{cand.ac_mode}")
    args = [*JOB, *lay.overrides(16), "--training.steps", str(steps),
            "--activation_checkpoint.mode", ac.mode,
            "--activation_checkpoint.selective_ac_option", ac.selective_ac_option,
            "--checkpoint.enable", "false", "--validation.enable", "false",
            "--metrics.log_freq", "1", "--metrics.save_plot", "false",
            "--data.dataset_path", dataset, "--job.dump_folder", dump,
            "--profiling.enable_memory_snapshot", "true", "--profiling.profile_freq", str(steps),
            "--profiling.profiler_warmup", "0", "--profiling.profiler_active", "1"]  # fmt: skip
    proc = launch(lay.world_size, args)
    if proc.returncode:
        return f"exit {proc.returncode}"
    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as f:
        ms = {r["step"]: r["step_time_ms"] for r in map(json.loads, f)}
    peaks = []
    for rank in range(lay.world_size):
        path = os.path.join(dump, "memory_snapshot", f"rank{rank}_step{steps}_peak.json")
        with open(path, encoding="utf-8") as f:
            peaks.append(json.load(f)["peak_live_bytes"])
    return statistics.median(ms[s] for s in range(3, steps)) / 1000, max(peaks)


def combined(results: list[tuple[float, int] | str]) -> tuple[float, int] | str:
    """One layout's figures over its passes: the mean of the median step times and the largest
    peak, or the first failure."""
    failed = [r for r in results if isinstance(r, str)]
    if failed:
        return failed[0]
    done = [r for r in results if not isinstance(r, str)]
    return statistics.mean(t for t, _ in done), max(m for _, m in done)


def key(cand) -> str:
    """A candidate's name in saved measurements: its layout and AC mode."""
    return f"{cand.layout.name}/{cand.ac_mode}"


def save(path: str, fitting: list, passes: list[dict]) -> None:
    """Write each pass's figures per candidate (`key`) as JSON, for `--measured`."""
    out = [{key(c): p[i] for i, c in enumerate(fitting)} for p in passes]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)


def reuse(path: str, fitting: list) -> list[dict[int, tuple[float, int] | str]]:
    """Saved passes (`save`) mapped onto this run's candidates; one the saved run did not
    measure (the model now picks another AC mode or batch for it) reads as not measured."""
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)

    def figures(got):
        return tuple(got) if isinstance(got, list) else got

    return [
        {i: figures(p.get(key(c), "not measured")) for i, c in enumerate(fitting)} for p in saved
    ]


def step_of(result: tuple[float, int] | str) -> float:
    """The step seconds of a measured (not failed) result."""
    assert not isinstance(result, str), result
    return result[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="interleaved passes over the layouts")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "planning.md"))
    p.add_argument("--save", default="", help="write the measurements to this JSON file")
    p.add_argument("--measured", default="",
                   help="rank against an earlier run's saved measurements instead of measuring "
                        "(the model and calibration are this run's)")  # fmt: skip
    a = p.parse_args(argv)
    from titanlab.config.manager import build_config
    from titanlab.data.default_corpus import default_cache_dir, ensure_default_corpus
    from titanlab.data.tokenizer import default_tokenizer_path
    from titanlab.planning import planner
    from titanlab.planning.report import calibrated

    config = build_config(JOB)
    args = planner.model_args_of(config)
    dataset = ensure_default_corpus(default_cache_dir(), default_tokenizer_path())
    with tempfile.TemporaryDirectory(prefix="titanlab_plan_check_") as work:
        cluster = calibrated(config, args, a.nproc, os.path.join(work, "cpu.json"))
        fitting = [c for c in planner.plan(config, args, cluster) if c.fits]
        passes: list[dict[int, tuple[float, int] | str]] = []
        if a.measured:
            passes = reuse(a.measured, fitting)
        for r in range(0 if a.measured else a.repeats):
            order = list(range(len(fitting)))[:: 1 if r % 2 == 0 else -1]
            got: dict[int, tuple[float, int] | str] = {}
            for n, i in enumerate(order, 1):
                began = time.time()
                got[i] = measure(fitting[i], a.steps, dataset, work)
                print(f"[pass {r + 1}, {n}/{len(fitting)}] {fitting[i].layout.name}: {got[i]} "
                      f"({time.time() - began:.0f} s)", flush=True)  # fmt: skip
            passes.append(got)
        if a.save:
            save(a.save, fitting, passes)
        rows = [(c, combined([p[i] for p in passes])) for i, c in enumerate(fitting)]
    ok = [(c, g) for c, g in rows if not isinstance(g, str)]
    retest = ""
    if len(passes) > 1:
        both = [i for i in range(len(fitting)) if all(not isinstance(p[i], str) for p in passes)]
        first, second = ([step_of(p[i]) for i in both] for p in passes[:2])
        retest = f" (pass 1 against pass 2: ρ = {spearman(first, second):.2f})"
    pred = [c.prediction.step_s for c, _ in ok]
    meas = [g[0] for _, g in ok]
    rho = spearman(pred, meas)
    mem_err = [c.memory.peak_tensors / g[1] - 1 for c, g in ok]
    best = min(meas)
    regret = meas[0] / best - 1  # `fitting` is in the planner's order: ok[0] is its pick
    lines = [
        "| # | layout | AC | predicted step (ms) | measured step (ms) | predicted peak (MiB) "
        "| measured peak (MiB) | memory error |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for i, (c, g) in enumerate(rows, 1):
        if isinstance(g, str):
            lines.append(f"| {i} | {c.layout.name} | {c.ac_mode} | {c.prediction.step_s * 1e3:.0f} | "
                         f"failed: {g} | | | |")  # fmt: skip
            continue
        lines.append(
            f"| {i} | {c.layout.name} | {c.ac_mode} | {c.prediction.step_s * 1e3:.0f} | "
            f"{g[0] * 1e3:.0f} | "
            f"{c.memory.peak_tensors / 2**20:.1f} | {g[1] / 2**20:.1f} | "
            f"{c.memory.peak_tensors / g[1] - 1:+.1%} |"
        )
    summary = (
        f"{len(ok)} of {len(rows)} layouts measured: Spearman ρ (predicted vs measured step "
        f"time) = {rho:.2f}{retest}; memory error {min(mem_err):+.1%} .. {max(mem_err):+.1%} "
        f"(worst |error| {max(abs(e) for e in mem_err):.1%}); the planner's first pick "
        f"{ok[0][0].layout.name} measured {meas[0] * 1e3:.0f} ms, the measured best "
        f"{ok[meas.index(best)][0].layout.name} {best * 1e3:.0f} ms ({regret:+.1%})."
    )
    import datetime
    import platform

    import torch

    command = " ".join(["python tools/plan_check.py", *(sys.argv[1:] if argv is None else argv)])
    about = (
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, {ram_gib():.0f} GiB RAM; Python "
        f"{platform.python_version()}, torch {torch.__version__}; {a.nproc} ranks of 1 intra-op "
        f"thread each; {datetime.date.today()}.\nCommand: `{command}`"
    )
    text = f"{about}\n\n{cluster_line(cluster)}\n\n" + "\n".join(lines) + f"\n\n{summary}"
    print(text)
    write_block(a.out, "plan-check-cpu", text)
    return 0


def cluster_line(cluster) -> str:
    e = cluster.efficiency
    return (
        f"Calibrated profile ({cluster.devices_per_node} ranks sharing {cluster.shared_cores} "
        f"cores): matmul {max(cluster.peak_flops.values()) / 1e9:.1f} GFLOP/s per rank, "
        f"attention {e.attention:.2f} of it, pointwise {e.pointwise:.2f} of the GEMM time, "
        f"optimizer {cluster.memory_bandwidth / 1e9:.1f} GB/s, link α "
        f"{cluster.intra_latency * 1e6:.0f} µs, β {cluster.intra_bandwidth / 1e9:.2f} GB/s, "
        f"split backward {cluster.split_backward_s * 1e3:.2f} ms per block and microbatch, TP "
        f"{cluster.tp_block_s * 1e3:.1f} ms per block and microbatch, FSDP "
        f"{cluster.fsdp_gather_s * 1e3:.2f} ms per all-gather and "
        f"{cluster.fsdp_reduce_s * 1e3:.2f} ms per reduce-scatter."
    )


if __name__ == "__main__":
    sys.exit(main())
