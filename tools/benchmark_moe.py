"""MoE rows of the benchmark: the Qwen3-MoE debug model on 2 ranks with expert parallel 1 and 2,
and the all-to-all share of an expert-parallel step.

    python tools/benchmark_moe.py [--steps 20] [--warmup 5] [--repeats 1] [--out docs/performance.md]

Trainer rows (`tools/benchmark.py`'s method: torchrun, `titanlab.train`, seq 256, global batch
16 over 2 ranks, fp32, eager, AC none, one intra-op thread per rank; step time and tokens/s of
one rank are medians after the warm-up): FSDP 2 with EP 1 (each rank runs all 8 experts on its
own tokens) and FSDP 2 with EP 2 (4 experts per rank, token slots exchanged by all-to-all).

All-to-all share: the same 2 ranks time, on their own, one step's expert-parallel traffic: per
MoE layer the exchange of the per-expert counts and four slot exchanges (dispatch and combine,
forward and backward), each of local tokens × top_k × dim fp32 split evenly between the ranks
(`torch.distributed.all_to_all_single`, gloo). That time over the EP 2 step time is the share.
It leaves out the load imbalance a real step adds (a rank waits for the busiest peer), so it is
a lower bound. The table replaces the `<!-- benchmark:cpu-moe:begin/end -->` block of `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tools.lib import bench

RANKS = 2


def a2a_child(layers: int, tokens: int, top_k: int, dim: int, iters: int) -> None:
    """(torchrun child) Print rank 0's median seconds of one step's all-to-all traffic."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    slots = torch.randn(tokens * top_k, dim)
    out = torch.empty_like(slots)
    counts = torch.full((8,), tokens * top_k // 8, dtype=torch.long)
    recv_counts = torch.empty_like(counts)
    split = [slots.shape[0] // world] * world
    times = []
    for i in range(iters + 3):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(layers):
            dist.all_to_all_single(recv_counts, counts)
            for _ in range(4):  # dispatch and combine, forward and backward
                dist.all_to_all_single(out, slots, split, split)
        if i >= 3:
            times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(json.dumps({"a2a_s": statistics.median(times)}))
    dist.destroy_process_group()


def time_a2a(layers: int, tokens: int, top_k: int, dim: int, iters: int = 20) -> float:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={RANKS}",
        os.path.abspath(__file__),
        "--a2a-child",
        json.dumps([layers, tokens, top_k, dim, iters]),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("{"))
    return float(json.loads(line)["a2a_s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats of both rows")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "performance.md"))
    p.add_argument("--a2a-child", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.a2a_child:
        a2a_child(*json.loads(a.a2a_child))
        return 0
    from titanlab.models.qwen3_moe import qwen3_moe_flavors

    info = bench.child({"kind": "probe"}, 1)
    if "error" in info:
        raise SystemExit(f"error: probe failed: {info['error']}")
    run = bench.Run(ranks=RANKS)
    rows: dict[int, list[bench.Result]] = {1: [], 2: []}
    for _ in range(a.repeats):
        for ep in rows:
            print(f"running qwen3_moe debugmodel, 2 ranks, EP {ep} ...", flush=True)
            rows[ep].append(
                bench.run_trainer(
                    run,
                    a.steps,
                    a.warmup,
                    1,
                    info["data_dir"],
                    "qwen3_moe",
                    ("--parallelism.expert_parallel_degree", str(ep)),
                )
            )
    results = {ep: bench.combine(rs) for ep, rs in rows.items()}
    for res in results.values():
        if res.error:
            raise SystemExit(f"error: {res.error}")
    args = qwen3_moe_flavors["debugmodel"]
    tokens = bench.GLOBAL_BS // RANKS * bench.SEQ
    assert args.moe is not None
    a2a_s = time_a2a(args.n_layers, tokens, args.moe.top_k, args.dim)
    ep2 = results[2]
    lines = [
        "| layout | step time (s) | tps (1 rank) | peak memory (GiB) | all-to-all share |",
        "|---|---|---|---|---|",
    ]
    for ep, res in results.items():
        share = f"{a2a_s / res.step_s:.1%} ({a2a_s * 1e3:.1f} ms)" if ep > 1 else "—"
        spread = f" [{res.spread[0]:.3f}–{res.spread[1]:.3f}]" if res.spread else ""
        lines.append(
            f"| FSDP 2 · EP {ep} | {res.step_s:.3f}{spread} | {res.tps:,.0f} | "
            f"{res.peak_gib:.2f} | {share} |"
        )
    command = shlex.join(
        ["python", "tools/benchmark_moe.py", *(sys.argv[1:] if argv is None else argv)]
    )
    about = bench.machine(info, 1, command)
    body = (
        f"{about}\n\nQwen3-MoE debugmodel (8 experts, top-2), 2 ranks, seq {bench.SEQ}, global "
        f"batch {bench.GLOBAL_BS}, fp32, eager. EP 2 / EP 1 tokens/s: "
        f"{ep2.tps / results[1].tps:.2f}.\n\n" + "\n".join(lines)
    )
    bench.publish(a.out, "cpu-moe", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
