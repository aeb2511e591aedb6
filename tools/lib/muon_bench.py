"""`tools/benchmark.py --matrix muon`: Muon against AdamW per layout, side by side.

Each layout trains `make train`'s job shape (the debug model, seq 256, global batch 16, fp32,
eager) with AdamW and with Muon (bfloat16 Newton–Schulz, torch.optim.Muon's default), runs
interleaved per repeat. A row gives the median step time of each, their ratio, the optimizer
step's median seconds (the slowest rank's), and for Muon the ranks' median Newton–Schulz compute
seconds (the owner-balanced split: `titanlab.components.muon_sharded`), their mean and the
slowest rank ÷ the mean, read from `TITANLAB_MUON_TIMES`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from tools.lib.bench import CONFIG, GLOBAL_BS, REPO, SEQ
from tools.lib.runs import failure_line

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1 rank": (1, []),
    "FSDP 2": (2, []),
    "ZeRO-1 2": (2, ["--parallelism.zero_stage", "1"]),
    "DDP 2": (2, ["--parallelism.zero_stage", "0"]),
    "TP 2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
}
OPTIMIZERS = ("AdamW", "Muon")


@dataclass
class Measured:
    """One run: per-step seconds after the warm-up, per rank the optimizer's and Newton–Schulz's
    seconds per step, or the error."""

    step_s: list[float] = field(default_factory=list)
    optimizer_s: dict[int, list[float]] = field(default_factory=dict)
    ns_s: dict[int, list[float]] = field(default_factory=dict)
    error: str = ""


def run(layout: str, optimizer: str, steps: int, warmup: int, data_dir: str) -> Measured:
    """Train `layout` with `optimizer` for warmup + steps steps under torchrun."""
    ranks, extra = LAYOUTS[layout]
    dp = ranks // (2 if "TP" in layout else 1)
    with tempfile.TemporaryDirectory(prefix="titanlab_muon_bench_") as dump:
        times = os.path.join(dump, "muon_times")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={ranks}", "-m", "titanlab.train", "--job.config_file", CONFIG,
            "--job.dump_folder", dump, "--data.dataset_path", data_dir,
            "--training.steps", str(warmup + steps), "--training.seq_len", str(SEQ),
            "--training.global_batch_size", str(GLOBAL_BS),
            "--training.local_batch_size", str(GLOBAL_BS // dp), "--metrics.log_freq", "1",
            "--checkpoint.enable", "false", "--validation.enable", "false",
            "--training.mixed_precision_param", "float32",
            "--loss.fused_linear_cross_entropy", "false", "--optimizer.name", optimizer, *extra,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   TITANLAB_MUON_TIMES=times)  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        path = os.path.join(dump, "metrics.jsonl")
        if proc.returncode != 0 or not os.path.exists(path):
            return Measured(error=f"exit {proc.returncode}: {failure_line(proc.stderr)}")
        out = Measured()
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        out.step_s = [r["step_time_ms"] / 1e3 for r in records if r["step"] > warmup]
        for rank in range(ranks):
            with open(f"{times}.rank{rank}.jsonl", encoding="utf-8") as f:
                rows = [json.loads(line) for line in f]
            rows = [r for r in rows if r["step"] > warmup]
            out.optimizer_s[rank] = [r["optimizer_s"] for r in rows]
            out.ns_s[rank] = [r["ns_s"] for r in rows]
        return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def merge(runs: list[Measured]) -> Measured:
    """The repeats of one (layout, optimizer) pooled."""
    out = Measured(error=next((r.error for r in runs if r.error), ""))
    for r in runs:
        out.step_s += r.step_s
        for rank, xs in r.optimizer_s.items():
            out.optimizer_s.setdefault(rank, []).extend(xs)
        for rank, xs in r.ns_s.items():
            out.ns_s.setdefault(rank, []).extend(xs)
    return out


def balance(m: Measured) -> tuple[float, float]:
    """The ranks' mean of their median Newton–Schulz seconds, and the slowest rank's ÷ it."""
    per_rank = [_median(xs) for xs in m.ns_s.values()]
    mean = sum(per_rank) / len(per_rank) if per_rank else float("nan")
    return mean, (max(per_rank) / mean if mean else float("nan"))


def render(results: dict[tuple[str, str], Measured]) -> str:
    """The Markdown table: a row per layout."""
    lines = [
        "| layout | AdamW step (s) | Muon step (s) | Muon ÷ AdamW | AdamW optimizer (s) | "
        "Muon optimizer (s) | Newton–Schulz (s), mean rank | slowest ÷ mean rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layout in LAYOUTS:
        a, m = results[(layout, "AdamW")], results[(layout, "Muon")]
        if a.error or m.error:
            lines.append(f"| {layout} | {a.error or '-'} | {m.error or '-'} | | | | | |")
            continue
        sa, sm = _median(a.step_s), _median(m.step_s)
        oa = max(_median(xs) for xs in a.optimizer_s.values())
        om = max(_median(xs) for xs in m.optimizer_s.values())
        ns, slowest = balance(m)
        lines.append(f"| {layout} | {sa:.3f} | {sm:.3f} | {sm / sa:.2f}× | {oa:.3f} | "
                     f"{om:.3f} | {ns:.3f} | {slowest:.2f} |")  # fmt: skip
    return "\n".join(lines)
