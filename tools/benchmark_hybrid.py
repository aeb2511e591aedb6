"""Qwen3.5's hybrid against softmax attention: one training step of same-size debug models.

    python tools/benchmark_hybrid.py [--seqs 512 2048 8192] [--repeats 3] [--out docs/models.md]
        [--no-write]

The Qwen3.5 debug shape (`qwen3_5` debugmodel: dim 256, 6 blocks, layers 0-2 and 4-5 Gated
DeltaNet with 4 key / 8 value heads of 32 / 24, layer 3 gated full attention with 8 query / 4 KV
heads of 48) against Qwen3's debug model of the same width, depth, attention heads and SwiGLU
(`qwen3` debugmodel: every block softmax attention, SDPA), batch 1, fp32, the machine's
threads: forward + backward of the loss, median of `--repeats` after a warm-up. Per token:
milliseconds, and the bytes the step keeps for backward (the memory estimator's trace on fake
tensors, `titanlab.planning.activation_memory`, whole model). The table replaces the
`hybrid-crossover` block of `--out`, with the sequence length where the hybrid's time per token
falls below softmax attention's (linear interpolation in log seq between the measured rows), or
a line saying it does not in the measured range.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODELS = ("qwen3_5", "qwen3")
KIB = 1024


def model_args(family: str, seq: int):
    from titanlab.models.registry import get_family, get_flavor

    args = get_flavor(get_family(family), "debugmodel")
    return dataclasses.replace(args, vocab_size=4096, max_seq_len=seq)


def step_ms(args, seq: int, repeats: int) -> float:
    """Median milliseconds of a forward + backward step of one sequence."""
    import torch

    from titanlab.models.registry import build_model
    from tools.lib.bench import median_step_seconds

    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (1, seq + 1))
    return 1e3 * median_step_seconds(model, tokens, repeats)


def kept_bytes(args, seq: int) -> int:
    """Bytes the whole model keeps for backward at batch 1 (no activation checkpointing)."""
    import torch

    from titanlab.planning.activation_memory import trace_activation_bytes

    trace = trace_activation_bytes(args, 1, seq, torch.float32)
    return trace.per_block["none"] * args.n_layers + trace.head_bytes(1)


def measure(seqs: list[int], repeats: int) -> list[dict]:
    rows = []
    for seq in seqs:
        for family in MODELS:
            args = model_args(family, seq)
            ms = step_ms(args, seq, repeats)
            row = {"model": family, "seq": seq, "ms": ms, "kept": kept_bytes(args, seq)}
            rows.append(row)
            print(row, flush=True)
    return rows


def crossover(rows: list[dict]) -> str:
    """Where the hybrid's time per token first falls below softmax attention's."""
    ratio = {}
    for r in rows:
        ratio.setdefault(r["seq"], {})[r["model"]] = r["ms"]
    points = sorted((s, m["qwen3_5"] / m["qwen3"]) for s, m in ratio.items())
    for (s0, r0), (s1, r1) in zip(points, points[1:], strict=False):
        if r0 > 1 >= r1:
            t = (math.log(r0)) / (math.log(r0) - math.log(r1))
            at = math.exp(math.log(s0) + t * (math.log(s1) - math.log(s0)))
            return f"The hybrid's step becomes the faster near seq ≈ {at:,.0f}."
    if points and points[0][1] <= 1:
        return f"The hybrid's step is the faster from seq {points[0][0]} on."
    last = points[-1] if points else (0, 0.0)
    return (
        f"The hybrid's step stays the slower up to seq {last[0]} on this machine "
        f"({last[1]:.2f}× softmax attention's time there)."
    )


def render(rows: list[dict], repeats: int) -> str:
    from titanlab.observability.hostinfo import cpu_model

    import torch

    lines = [
        f"Measured with `python tools/benchmark_hybrid.py` on {cpu_model()}, {os.cpu_count()} "
        f"cores, {torch.get_num_threads()} threads; Python {platform.python_version()}, torch "
        f"{torch.__version__}; {datetime.date.today()}. Qwen3.5's debug model (5 Gated DeltaNet "
        "layers, 1 gated full-attention layer) against Qwen3's of the same width, depth and "
        f"heads (6 softmax-attention layers), batch 1, fp32; forward + backward of the loss, "
        f"median of {repeats}. Kept: what the step keeps for backward (the memory estimator's "
        "trace).",
        "",
        "| seq | model | ms / step | µs / token | kept for backward (KiB / token) | time vs qwen3 |",
        "|---|---|---|---|---|---|",
    ]
    by_seq = {(r["seq"], r["model"]): r for r in rows}
    for r in rows:
        base = by_seq[r["seq"], "qwen3"]
        lines.append(
            f"| {r['seq']} | {r['model']} | {r['ms']:.1f} | {1e3 * r['ms'] / r['seq']:.1f} | "
            f"{r['kept'] / r['seq'] / KIB:.1f} | {r['ms'] / base['ms']:.2f}× |"
        )
    lines += ["", crossover(rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "models.md"))
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    rows = measure(a.seqs, a.repeats)
    table = render(rows, a.repeats)
    print(table)
    if not a.no_write:
        from tools.lib.bench import write_block

        write_block(a.out, "hybrid-crossover", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
