"""The MoE rows of a lent GPU's session: Qwen3-30B-A3B's shape (4 of its 48 blocks, its 128
experts, top-8, seq_len 4096, local batch 1) on one GPU, each row measured by the trainer
(`tools/gpu_bench_row.py`) beside what the per-op ledger predicts for the same command on
that GPU's profile, so the first GPU that runs them says how far the ledger's MoE pricing is
from the hardware.

    python tools/gpu_moe_rows.py --out ROWS.json                # on a GPU: measure and predict
    python tools/gpu_moe_rows.py --ledger-only --device h100    # anywhere: the predictions

Rows: bf16 compiled (the experts eager, compile's MoE boundary: docs/moe.md), bf16 eager,
float8 tensorwise compiled (torchao's float8 on the dense linears: attention and the router's
projections; the experts stay bf16), and the experts' grouped GEMMs in float8 rowwise
(`float8.grouped_experts`, torchao's float8 grouped GEMM; the dense linears bf16). Selective AC
(op), as train_configs/qwen3_30b_a3b.toml ships. One GPU: no expert parallel, so no
all-to-all; what the row prices is the experts' grouped GEMMs, the router, the permutation and
attention at the real width. A printed table: the measured median step, tokens/s and MFU, the
ledger's step and MFU, and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.gpu_rows import bench_row

CONFIG = os.path.join(REPO, "train_configs", "qwen3_30b_a3b.toml")
BLOCKS = 4
ONE_GPU = [
    "--model.n_layers", str(BLOCKS),
    "--parallelism.data_parallel_shard_degree", "1",
    "--parallelism.expert_parallel_degree", "1",
    "--comm.fake_world_size", "1",
    "--checkpoint.enable", "false",
    "--metrics.log_freq", "1",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MoERow:
    name: str
    args: tuple[str, ...]


ROWS = (
    MoERow("bf16 · compile", ("--compile.enable", "true", "--compile.components", "model,loss")),
    MoERow("bf16 · eager", ("--compile.enable", "false")),
    MoERow(
        "float8 tensorwise (dense linears) · compile",
        (
            "--compile.enable",
            "true",
            "--compile.components",
            "model,loss",
            "--float8.enable",
            "true",
            "--float8.recipe_name",
            "tensorwise",
        ),
    ),
    MoERow(
        "float8 rowwise grouped experts (dense linears bf16) · compile",
        ("--compile.enable", "true", "--compile.components", "model,loss",
         "--float8.enable", "true", "--float8.grouped_experts", "true",
         "--float8.filter_fqns", "output,attention,router"),
    ),
)  # fmt: skip


def trainer_args(row: MoERow, dump: str, steps: int) -> list[str]:
    """The trainer's command line of `row` (one GPU, `BLOCKS` blocks, `steps` steps)."""
    return ["--job.config_file", CONFIG, *ONE_GPU, "--job.dump_folder", dump,
            "--training.steps", str(steps), *row.args]  # fmt: skip


def predict(row: MoERow, device: str) -> dict:
    """The ledger's step (s), tokens/s and MFU for `row` on `device` (a cluster profile)."""
    from titanlab.ledger.report import summary
    from titanlab.ledger.run import build_ledger

    with tempfile.TemporaryDirectory() as dump:
        s = summary(build_ledger(trainer_args(row, dump, 1), device))
    return {"step_s": s["step_s"], "tokens_per_s": s["tokens_per_s"], "mfu": s["mfu"]}


def measure(row: MoERow, steps: int, warmup: int, timeout_s: int) -> dict:
    """`tools/gpu_bench_row.py`'s JSON for `row` (`tools.lib.gpu_rows.bench_row`)."""
    with tempfile.TemporaryDirectory() as folder:
        argv = trainer_args(row, os.path.join(folder, "dump"), steps)
        return bench_row(argv, folder, warmup, timeout_s=timeout_s)


def gpu_profile() -> str:
    """The cluster profile of this machine's GPU (h100, h200, ...), from its name."""
    import torch

    name = torch.cuda.get_device_name(0).lower()
    for profile in ("h200", "h100", "b200", "a100"):
        if profile in name:
            return profile
    raise SystemExit(f"gpu_moe_rows: no ledger profile for GPU {name!r}; give --device")


def table(results: list[dict]) -> str:
    """Markdown: a row per MoE row, measured against predicted."""
    lines = ["| row | measured step (ms) | tokens/s | MFU | ledger step (ms) | ledger MFU | "
             "ledger / measured |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        led, got = r["ledger"], r.get("measured", {})
        if "median_step_s" in got:
            ratio = led["step_s"] / got["median_step_s"]
            measured = (f"{got['median_step_s'] * 1e3:.1f} | {got['tps']:.0f} | "
                        f"{100 * (got['mfu'] or 0):.1f}%")  # fmt: skip
        else:
            ratio, measured = None, f"{got.get('error', 'not run')} | — | —"
        lines.append(f"| {r['row']} | {measured} | {led['step_s'] * 1e3:.1f} | "
                     f"{100 * led['mfu']:.1f}% | {f'{ratio:.2f}' if ratio else '—'} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", help="write every figure here (JSON)")
    p.add_argument("--device", default="", help="ledger profile (default: this GPU's)")
    p.add_argument("--ledger-only", action="store_true", help="no GPU: the predictions only")
    p.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--timeout-s", type=int, default=300)
    p.add_argument("--budget-s", type=int, default=0, help="no row starts after this (0: none)")
    a = p.parse_args(argv)
    rows = [r for r in ROWS if not a.rows or r.name in a.rows.split(",")]
    device = a.device or ("h100" if a.ledger_only else gpu_profile())
    start, results = time.time(), []
    for row in rows:
        if a.budget_s and time.time() - start > a.budget_s:
            print(f"gpu_moe_rows: {row.name} not run, past --budget-s {a.budget_s}", flush=True)
            break
        result = {"row": row.name, "device": device, "ledger": predict(row, device)}
        if not a.ledger_only:
            result["measured"] = measure(row, a.steps, a.warmup, a.timeout_s)
        results.append(result)
        print(json.dumps(result)[:600], flush=True)
        if a.out:
            with open(a.out, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=1)
    print(f"\nQwen3-30B-A3B, {BLOCKS} blocks, seq_len 4096, 1 GPU, ledger profile {device}\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
