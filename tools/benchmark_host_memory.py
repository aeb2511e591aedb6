"""Host memory over a long run: how rank 0's resident size, its Python objects, torch's caches and
glibc's heap grow per 1,000 steps, for each optimizer and layout.

    python tools/benchmark_host_memory.py [--steps 2000] [--warmup 200] [--every 100]
        [--flavor debugmodel] [--runs fsdp-fused fsdp-foreach ...] [--env NAME=VALUE ...]
        [--out docs/performance.md] [--no-write] [-- TRAIN_OVERRIDES ...]

Each run trains `make train`'s job (`train_configs/debug_model.toml`: the default corpus,
a checkpoint every 50 steps, validation every 75) at seq 64 and 2 samples per rank, under
torchrun, 1 intra-op thread per rank, for `--steps` steps. Rank 0 samples itself at step
`--warmup` and every `--every` steps to `--steps`, each time after the step before (199, 299,
...: just before the loop's `gc.collect(1)` every `training.gc_freq` steps; `--every`
should be a multiple of it, 50). A sample
(`tools.lib.host_memory`) reads VmRSS and the token shards' mapped pages, glibc's heap in use
and free, the objects the cyclic collector tracks (counted without a collection), tracemalloc's
traced bytes (traced from step 1; `--no-tracemalloc` leaves it off) and DTensor's
sharding-propagation cache; a column is the least-squares slope over the samples, per 1,000
steps. Before the first sample the process is still filling its caches and heaps (~20 MiB over
the first 500 steps on 2 ranks), so the warm-up should cover that. After the last sample rank 0
calls `malloc_trim(0)`: what that hands back is heap the allocator held free. `--env` sets a
variable for the ranks (e.g. `MALLOC_ARENA_MAX=2`); options after `--` go to every run. The
table replaces block `host-memory` of `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import os
import platform
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.runs import DEBUG_CONFIG, failure_line, launch_command

RUNS: dict[str, tuple[str, int, list[str]]] = {
    "1rank-fused": ("1 rank · AdamW fused", 1, []),
    "fsdp-fused": ("FSDP 2 · AdamW fused", 2, []),
    "fsdp-foreach": ("FSDP 2 · AdamW foreach", 2, ["--optimizer.implementation", "foreach"]),
    "fsdp-muon": ("FSDP 2 · Muon", 2, ["--optimizer.name", "Muon"]),
    "hsdp": ("HSDP 2×1 · AdamW fused", 2,
             ["--parallelism.data_parallel_replicate_degree", "2",
              "--parallelism.data_parallel_shard_degree", "1"]),
    "tp": ("TP 2 · AdamW fused", 2, ["--parallelism.tensor_parallel_degree", "2"]),
}  # fmt: skip
"""Key → (row name, ranks, overrides). AdamW's implementation is `fused` unless named."""


@dataclasses.dataclass
class Row:
    """One run: VmRSS at the first sample, then slopes per 1,000 steps (MiB unless named)."""

    name: str
    rss_start: float = math.nan
    rss: float = math.nan  # less tracemalloc's own memory
    data: float = math.nan  # the memory-mapped token shards' resident pages
    heap: float = math.nan  # glibc's heap in use, less tracemalloc's own memory
    heap_free: float = math.nan
    objects: float = math.nan
    top: str = ""
    traced: float = math.nan
    cache: float = math.nan
    trimmed: float = math.nan  # MiB malloc_trim(0) handed back after the last step
    step_s: float = math.nan
    error: str = ""


def measure(key: str, a: argparse.Namespace, env: dict[str, str], extra: list[str]) -> Row:
    """Train run `key` under torchrun and read rank 0's samples."""
    from tools.lib import host_memory as hm

    name, ranks, overrides = RUNS[key]
    with tempfile.TemporaryDirectory(prefix="titanlab_host_memory_") as dump:
        out = os.path.join(dump, "samples.json")
        args = ["--job.config_file", DEBUG_CONFIG, "--job.dump_folder", dump,
                "--model.flavor", a.flavor, "--training.steps", str(a.steps),
                "--training.seq_len", "64", "--training.local_batch_size", "2",
                "--metrics.save_plot", "false", "--checkpoint.export_at_end", "false",
                *overrides, *extra]  # fmt: skip
        target = [os.path.abspath(__file__), "--rank-main", out, str(a.every), str(a.warmup),
                  str(int(a.tracemalloc))]  # fmt: skip
        cmd = launch_command(ranks, [*target, *args])
        run_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
        proc = subprocess.run(cmd, cwd=REPO, env=run_env, capture_output=True, text=True)
        if proc.returncode or not os.path.exists(out):
            return Row(name, error=f"exit {proc.returncode}: "
                       f"{failure_line(proc.stderr + proc.stdout)}")  # fmt: skip
        samples, record = hm.read_samples(out)
    for s in samples:  # the run's samples, for the record
        print(f"  {name} step {s.step}: VmRSS {s.rss_mib:.1f} (anon {s.anon_mib:.1f}, file "
              f"{s.file_mib:.1f}, shards {s.data_mib:.1f}), heap in use {s.heap_used_mib:.1f} "
              f"free {s.heap_free_mib:.1f}, objects {s.objects}, items {s.items}, "
              f"tracemalloc's own {s.tracing_mib:.1f} MiB", flush=True)  # fmt: skip
    slope = functools.partial(hm.per_thousand, samples)
    return Row(
        name,
        rss_start=samples[0].rss_mib,
        rss=slope(lambda s: s.rss_mib - s.tracing_mib),
        data=slope("data_mib"),
        heap=slope(lambda s: s.heap_used_mib - s.tracing_mib),
        heap_free=slope("heap_free_mib"),
        objects=slope("objects"),
        top=", ".join(f"{n.rsplit('.', 1)[-1]} +{c}" for n, c in record["top"][:2]) or "none",
        traced=slope("traced_mib"),
        cache=slope("sharding_cache"),
        trimmed=record["trimmed_mib"],
        step_s=record["step_s"],
    )


COLUMNS = (
    "run", "VmRSS at the first sample (MiB)", "VmRSS", "of it the token shards' mapped pages",
    "glibc heap in use", "glibc heap free", "tracked Python objects (count; most grown types)",
    "tracemalloc", "DTensor sharding cache (entries)", "malloc_trim(0) hands back (MiB)",
    "s / step",
)  # fmt: skip


def render(rows: list[Row], a: argparse.Namespace, command: str, env: dict[str, str]) -> str:
    import torch

    from titanlab.observability.hostinfo import cpu_model, ram_gib

    allocator = ", ".join(f"{k}={v}" for k, v in env.items()) or "titanlab's fixed thresholds"
    traced = "from step 1 on rank 0" if a.tracemalloc else "off (--no-tracemalloc)"
    lines = [
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, {ram_gib():.0f} GiB RAM; Python "
        f"{platform.python_version()}, torch {torch.__version__}; {datetime.date.today()}. "
        f"Command: `{command}`. `make train`'s job (llama3 {a.flavor}, seq 64, 2 samples per "
        f"rank, a checkpoint every 50 steps, validation every 75), 1 thread per rank; glibc "
        f"malloc with {allocator}; tracemalloc {traced}. Rank 0 sampled itself after step "
        f"{a.warmup - 1} and every {a.every} steps to step {a.steps - 1} (before the loop's "
        f"collection every 50 steps); from VmRSS on, each column is "
        "the least-squares slope over those samples per 1,000 steps (MiB, or a count); VmRSS "
        "and the heap in use leave out what tracemalloc holds for its own traces.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|" + "---:|" * (len(COLUMNS) - 1),
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.name} | {r.error[:150].replace('|', '/')} |" + " |" * 9)
            continue
        lines.append(
            f"| {r.name} | {r.rss_start:.0f} | {r.rss:+.1f} | {r.data:+.1f} | {r.heap:+.2f} "
            f"| {r.heap_free:+.1f} | {r.objects:+.0f} ({r.top}) | {r.traced:+.2f} "
            f"| {r.cache:+.0f} | {r.trimmed:.0f} | {r.step_s:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-main"]:  # one rank of a run, under torchrun
        from tools.lib.host_memory import run_sampled

        out, every, warmup, trace, *args = argv[1:]
        steps = int(args[args.index("--training.steps") + 1])
        at = range(int(warmup) - 1, steps, int(every))  # before the loop's collection
        return run_sampled(out, at, args, trace_from=int(trace))  # tracemalloc from step 1
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="steps of each run")
    p.add_argument("--warmup", type=int, default=200, help="sampled first after step WARMUP - 1")
    p.add_argument("--every", type=int, default=100, help="steps between samples")
    p.add_argument("--flavor", default="debugmodel", help="llama3 flavor")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument(
        "--no-tracemalloc",
        dest="tracemalloc",
        action="store_false",
        help="leave tracemalloc off (its bookkeeping is part of rank 0's VmRSS)",
    )
    p.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                   help="environment of the ranks, e.g. MALLOC_ARENA_MAX=2")  # fmt: skip
    p.add_argument("--out", default=os.path.join(REPO, "docs", "performance.md"))
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    if not 0 < a.warmup < a.steps or a.every < 1 or a.steps - a.warmup < a.every:
        p.error(f"need 0 < --warmup < --steps with at least --every steps between them; got "
                f"--warmup {a.warmup} --steps {a.steps} --every {a.every}")  # fmt: skip
    env = dict(kv.split("=", 1) for kv in a.env)
    command = " ".join(["python tools/benchmark_host_memory.py", *sys.argv[1:]])
    rows = []
    for key in a.runs:
        rows.append(measure(key, a, env, extra))
        print(rows[-1], flush=True)
    table = render(rows, a, command, env)
    print(table)
    if not a.no_write:
        from tools.lib.bench import write_block

        write_block(a.out, "host-memory", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
