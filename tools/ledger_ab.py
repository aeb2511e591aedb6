"""The titanlab / torchtitan A/B as the per-op ledger predicts it: both stacks' steps recorded
under the same fake tensors and priced for the same GPU, row by row beside the steps the H200
measured on 2026-11-27 (docs/performance.md, block `torchtitan-ab`).

    python tools/ledger_ab.py [--device h200] [--layers 11] [--write]

Each row of `tools/benchmark_torchtitan.py`'s GPU A/B (`GPU_ROWS`): titanlab's trainer as that
benchmark runs it (`train_configs/llama_8b.toml`, Llama 3.1 8B's dims with `--layers` blocks,
vocab 128,256, seq_len 8192, local batch 1, one GPU, the code as it is now) and torchtitan
0.2.2's step with the same options (`tools/lib/torchtitan_ledger.py`). Where the H200 measured
torchtitan, its measured step and the ledger's error on it. `--write` puts the table in
docs/performance.md (block `ledger-ab`). Needs torchtitan (the dev extra).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.ab_rows import GPU_ROWS
from tools.lib.bench import write_block
from tools.lib.llama_blocks import LAYERS, model_args
from tools.lib.torchtitan_ledger import Shape, step_builder

MEASURED_TORCHTITAN_S = {  # H200, 2026-11-27: 8,192 tokens over torchtitan's tokens/s
    "bf16 · compile · AC none": 8192 / 24991,
    "float8 tensorwise · compile · AC none": 8192 / 29163,
    "bf16 · compile · AC selective": 8192 / 23260,
}
MEASURED_TITANLAB_S = {  # the same run, with the fused loss's fp32 weight gradient
    "bf16 · compile · AC none": 8192 / 14954,
    "float8 tensorwise · compile · AC none": 8192 / 16219,
    "bf16 · compile · AC selective": 8192 / 14198,
}


def predict(row, device: str, layers: int, folder: str) -> tuple[float, float]:
    """(titanlab's, torchtitan's) predicted step seconds of `row`."""
    from titanlab.ledger.loop import ledger_of_loop
    from titanlab.ledger.run import build_ledger

    argv = ["--job.config_file", os.path.join(REPO, "train_configs", "llama_8b.toml"),
            "--comm.fake_world_size", "1", *model_args(folder, layers), *row.titanlab_args()]  # fmt: skip
    ours = build_ledger(argv, device).priced.step_s
    shape = Shape(n_layers=layers)
    build = step_builder(shape, row.torchtitan_args())
    theirs = ledger_of_loop(build, device, shape.seq_len, 0.0, "torchtitan", shape.seq_len)
    return ours, theirs.priced.step_s


def table(results: list[tuple[str, float, float]]) -> str:
    lines = [
        "| row | titanlab predicted s | torchtitan predicted s | predicted titanlab / torchtitan "
        "speed | measured: titanlab (fp32 head gradient) · torchtitan s | ledger's error on "
        "torchtitan |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, ours, theirs in results:
        measured, error = "not measured", "-"
        if name in MEASURED_TORCHTITAN_S:
            tt = MEASURED_TORCHTITAN_S[name]
            measured = f"{MEASURED_TITANLAB_S[name]:.3f} · {tt:.3f}"
            error = f"{100 * (theirs / tt - 1):+.1f}%"
        lines.append(f"| {name} | {ours:.3f} | {theirs:.3f} | {theirs / ours:.3f}× | {measured} "
                     f"| {error} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="h200", help="cluster profile (default h200: the A/B's)")
    p.add_argument("--layers", type=int, default=LAYERS, help="Llama 3 8B blocks")
    p.add_argument("--write", action="store_true", help="write the table to docs/performance.md")
    opts = p.parse_args(argv)
    start, results = time.time(), []
    with tempfile.TemporaryDirectory() as folder:
        for row in GPU_ROWS:
            ours, theirs = predict(row, opts.device, opts.layers, folder)
            results.append((row.name, ours, theirs))
            print(f"{row.name}: titanlab {ours:.3f} s, torchtitan {theirs:.3f} s", flush=True)
    text = table(results)
    print(text)
    if opts.write:
        head = (f"`python tools/ledger_ab.py --write` ({time.time() - start:.0f} s on this CPU): "
                f"both stacks' steps priced for the {opts.device.upper()} by the per-op ledger, "
                f"Llama 3.1 8B dims with {opts.layers} blocks, seq_len 8192, local batch 1, one "
                "GPU; titanlab's code as it is now, beside what the H200 measured on 2026-11-27."
                "\n\n")  # fmt: skip
        write_block(os.path.join(REPO, "docs", "performance.md"), "ledger-ab", head + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
