"""Ring against Ulysses context parallel on this machine: one attention call per rank.

    python tools/benchmark_cp.py [--cps 2,4] [--seq 2048] [--heads 8] [--head-dim 64]
        [--repeats 5] [--out docs/parallelism.md] [--no-write]

For cp 1 (SDPA with the whole mask) and each cp of `--cps` × (ring allgather, ring alltoall,
Ulysses): q, k, v of a window of mixed-length documents (restarted positions), forward +
backward through `ContextParallelAttention` on gloo ranks, one thread each
(tools/lib/cp_bench.py). Columns: the slowest rank's median seconds; the bytes one rank
communicates per call, counted by `CommCounter` and checked equal to the closed form (a
mismatch fails the run); the largest rank's bytes that attention saves for backward (its
activation memory), against one process's. The table replaces the `cp-modes` block of `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MIB = 2**20


def rows(cps: list[int], shape, repeats: int) -> list[dict]:
    from tools.lib.cp_bench import METHODS, measure

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        out.append(measure(1, METHODS[0], shape, repeats, tmp))
        for cp in cps:
            for method in METHODS:
                r = measure(cp, method, shape, repeats, tmp)
                print(r, flush=True)
                out.append(r)
    return out


def render(results: list[dict], shape, repeats: int) -> str:
    from titanlab.observability.hostinfo import cpu_model

    one = results[0]
    lines = [
        f"Measured with `python tools/benchmark_cp.py` on {cpu_model()}, {os.cpu_count()} cores; "
        f"Python {platform.python_version()}; {datetime.date.today()}. One attention call "
        f"(forward + backward), fp32, bs {shape.batch}, {shape.heads} heads of {shape.head_dim}, "
        f"a window of {shape.seq} tokens of mixed-length documents (restarted positions), one "
        f"gloo rank per cp rank, one thread each; the slowest rank's median of {repeats}.",
        "",
        "| method | cp | s / call | bytes / call per rank (counted = closed form) | "
        "saved for backward per rank (MiB) | vs 1 process |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        counted = sum(r["kinds"].values())
        check = (
            ""
            if r["cp"] == 1
            else (" ✓" if r["kinds"] == r["closed_form"] else " **≠ closed form**")
        )
        kinds = ", ".join(f"{k} {v / MIB:.2f} MiB" for k, v in sorted(r["kinds"].items())) or "—"
        lines.append(
            f"| {r['method']} | {r['cp']} | {r['seconds']:.4f} | {kinds}"
            f"{f' (total {counted / MIB:.2f})' if r['kinds'] else ''}{check} | "
            f"{r['saved_bytes'] / MIB:.2f} | {r['saved_bytes'] / one['saved_bytes']:.2f}× |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tools.lib.cp_bench import Shape

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cps", default="2,4")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "parallelism.md"))
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    shape = Shape(1, a.heads, a.seq, a.head_dim)
    results = rows([int(c) for c in a.cps.split(",")], shape, a.repeats)
    table = render(results, shape, a.repeats)
    print(table)
    if not a.no_write:
        from tools.lib.bench import write_block

        write_block(a.out, "cp-modes", table)
    bad = [r for r in results if r["cp"] > 1 and r["kinds"] != r["closed_form"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
