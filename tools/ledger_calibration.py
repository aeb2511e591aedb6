"""The ledger against the GPU rows measured so far: predicted and measured step time of every
titanlab row of docs/performance.md, with the error.

    python tools/ledger_calibration.py [--write]

Each row is `titanlab ledger` of the run `tools/gpu_check.py` timed (train_configs/llama_8b.toml
on Llama 3.1 8B's dims with 11 of 32 blocks, vocab 128,256, seq_len 8192, local batch 1, one
GPU), on the code that ran then: the H100 rows of 2026-11-23 before the fused loss existed
(`--loss.fused_linear_cross_entropy false`), the H200 rows of 2026-11-27 with the fused loss's
weight gradient accumulated as fp32 GEMMs (the defect, put back for the prediction). `--write`
puts the table in docs/performance.md (block `ledger-calibration`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.bench import write_block

LAYERS = 11
PLAIN_LOSS = ("--loss.fused_linear_cross_entropy", "false")
FLOAT8_TW = ("--float8.enable", "true", "--float8.recipe_name", "tensorwise")
FLOAT8_RW = ("--float8.enable", "true", "--float8.recipe_name", "rowwise")
SELECTIVE = ("--activation_checkpoint.mode", "selective")
EAGER = ("--compile.enable", "false")


@dataclasses.dataclass(frozen=True)
class Row:
    """A measured GPU row: its name, device profile, measured step seconds, where it is
    recorded, the ledger's options, and whether the fp32 weight-gradient defect ran."""

    name: str
    device: str
    measured_s: float
    source: str
    args: tuple[str, ...]
    fp32_head_grad: bool = False


ROWS = (
    Row("bf16 · compile · AC none", "h100", 0.333, "H100 2026-11-23", PLAIN_LOSS),
    Row("float8 tensorwise · compile · AC none", "h100", 0.304, "H100 2026-11-23",
        PLAIN_LOSS + FLOAT8_TW),
    Row("float8 rowwise · compile · AC none", "h100", 0.337, "H100 2026-11-23",
        PLAIN_LOSS + FLOAT8_RW),
    Row("bf16 · compile · AC selective", "h100", 0.366, "H100 2026-11-23", PLAIN_LOSS + SELECTIVE),
    Row("float8 tensorwise · compile · AC selective", "h100", 0.301, "H100 2026-11-23",
        PLAIN_LOSS + FLOAT8_TW + SELECTIVE),
    Row("bf16 · eager · AC none", "h100", 0.395, "H100 2026-11-23", PLAIN_LOSS + EAGER),
    # the H200 rows of the torchtitan A/B: 8,192 tokens over titanlab's tokens/s
    Row("bf16 · compile · AC none (fused loss, fp32 head gradient)", "h200", 8192 / 14954,
        "H200 2026-11-27", (), fp32_head_grad=True),
    Row("float8 tensorwise · compile · AC none (fused loss, fp32 head gradient)", "h200",
        8192 / 16219, "H200 2026-11-27", FLOAT8_TW, fp32_head_grad=True),
    Row("bf16 · compile · AC selective (fused loss, fp32 head gradient)", "h200", 8192 / 14198,
        "H200 2026-11-27", SELECTIVE, fp32_head_grad=True),
)  # fmt: skip


@contextlib.contextmanager
def fp32_head_gradient(on: bool):
    """The fused loss's weight gradient summed as fp32 GEMMs, as before 2026-11-28's fix."""
    import titanlab.components.fused_ce as fused_ce

    before = fused_ce._add_product

    def fp32_everywhere(acc, a, b):
        acc.addmm_(a.float(), b.float())

    if on:
        fused_ce._add_product = fp32_everywhere
    try:
        yield
    finally:
        fused_ce._add_product = before


def model_args(folder: str) -> list[str]:
    import torch

    from titanlab.models.registry import get_family

    family = get_family("llama3")
    args = dataclasses.replace(family.flavors["8B"], n_layers=LAYERS, vocab_size=128256)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(family.hf.to_config(args, torch.bfloat16, 8192, None, None), f)
    return ["--model.flavor", "hf", "--model.hf_config", folder]


def predict(row: Row, folder: str):
    from titanlab.ledger.run import build_ledger

    config = os.path.join(REPO, "train_configs", "llama_8b.toml")
    argv = ["--job.config_file", config, "--comm.fake_world_size", "1", *model_args(folder),
            "--activation_checkpoint.mode", "none"]  # fmt: skip
    with fp32_head_gradient(row.fp32_head_grad):
        return build_ledger([*argv, *row.args], row.device)


def table(results: list[tuple[Row, float]]) -> str:
    lines = [
        "| row | device | measured s | predicted s | error |",
        "|---|---|---:|---:|---:|",
    ]
    for row, predicted in results:
        error = predicted / row.measured_s - 1
        lines.append(f"| {row.name} | {row.source} | {row.measured_s:.3f} | {predicted:.3f} | "
                     f"{100 * error:+.1f}% |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="write the table to docs/performance.md")
    opts = p.parse_args(argv)
    start = time.time()
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for row in ROWS:
            ledger = predict(row, folder)
            results.append((row, ledger.priced.step_s))
            print(f"{row.name} ({row.source}): measured {row.measured_s:.3f} s, predicted "
                  f"{ledger.priced.step_s:.3f} s", flush=True)  # fmt: skip
    text = table(results)
    print(text)
    if opts.write:
        head = (f"`python tools/ledger_calibration.py --write` ({time.time() - start:.0f} s on "
                "this CPU): the ledger's step against the measured one, Llama 3.1 8B dims with "
                f"{LAYERS} blocks, seq_len 8192, local batch 1, one GPU.\n\n")  # fmt: skip
        write_block(os.path.join(REPO, "docs", "performance.md"), "ledger-calibration",
                    head + text)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
