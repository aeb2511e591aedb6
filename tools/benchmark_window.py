"""Sliding-window against full attention: one training step of the same gpt-oss model.

    python tools/benchmark_window.py [--window 128] [--windows-per-seq 4] [--batch 4]
        [--repeats 5] [--out docs/performance.md] [--no-write]

The gpt-oss debug shape (dim 256, 8 heads of 32 with sinks, 8 biased experts, top-2) with every
block sliding (window W), against the same weights with every block full, at seq_len =
`--windows-per-seq` × W: forward + backward of the loss, fp32, one thread, median of
`--repeats` after a warm-up. Memory: what the step keeps for backward, per block, traced on fake
tensors by the memory estimator (`titanlab.planning.activation_memory`), and the peak of the
step from the profiler. The table replaces the `sliding-window` block of `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MIB = 2**20


def model_args(window: int, seq: int, kind: str):
    from titanlab.models.gpt_oss import gpt_oss_flavors

    base = gpt_oss_flavors["debugmodel"]
    types = (f"{kind}_attention",) * base.n_layers
    return dataclasses.replace(
        base, sliding_window=window, layer_types=types, vocab_size=4096, max_seq_len=seq
    )


def step_seconds(args, batch: int, seq: int, repeats: int) -> tuple[float, int]:
    """(median seconds of a forward + backward step, peak bytes of one step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    from titanlab.components.loss import cross_entropy_sum
    from titanlab.models.registry import build_model
    from tools.lib.bench import median_step_seconds

    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1))
    seconds = median_step_seconds(model, tokens, repeats)

    def step() -> None:
        cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        model.zero_grad(set_to_none=True)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:  # fmt: skip
        step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    import numpy as np

    return seconds, int(np.asarray(sizes).sum(axis=1).max())


def measure(window: int, per_seq: int, batch: int, repeats: int) -> list[dict]:
    import torch

    from titanlab.planning.activation_memory import trace_activation_bytes

    torch.set_num_threads(1)
    seq = window * per_seq
    rows = []
    for kind in ("sliding", "full"):
        args = model_args(window, seq, kind)
        seconds, peak = step_seconds(args, batch, seq, repeats)
        block = trace_activation_bytes(args, batch, seq, torch.float32).per_block["none"]
        rows.append({"kind": kind, "seq": seq, "s": seconds, "peak": peak, "block": block})
        print(rows[-1], flush=True)
    return rows


def render(rows: list[dict], window: int, batch: int, repeats: int) -> str:
    from titanlab.observability.hostinfo import cpu_model

    full = rows[-1]
    lines = [
        f"Measured with `python tools/benchmark_window.py` on {cpu_model()}, {os.cpu_count()} "
        f"cores; Python {platform.python_version()}; {datetime.date.today()}. gpt-oss debug "
        f"shape (dim 256, 4 blocks, 8 heads of 32 with sinks, 8 experts top-2), every block "
        f"sliding (window {window}) or every block full, seq {rows[0]['seq']}, batch {batch}, "
        f"fp32, one thread; forward + backward of the loss, median of {repeats}.",
        "",
        "| attention | s / step | vs full | kept for backward per block (MiB) | "
        "peak of the step (MiB) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['s']:.3f} | {r['s'] / full['s']:.2f}× | "
            f"{r['block'] / MIB:.1f} | {r['peak'] / MIB:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--windows-per-seq", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "performance.md"))
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    rows = measure(a.window, a.windows_per_seq, a.batch, a.repeats)
    table = render(rows, a.window, a.batch, a.repeats)
    print(table)
    if not a.no_write:
        from tools.lib.bench import write_block

        write_block(a.out, "sliding-window", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
