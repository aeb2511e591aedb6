"""The layout planner's picks for the published model sizes on H100 clusters (docs/planning.md).

    python tools/plan_table.py [--gpus 8 64 512 2048] [--models llama_8b ...] [--out docs/planning.md]

For each train_configs/<model>.toml (Llama 3 8B, 70B, 405B, Qwen3-30B-A3B; seq_len 8192 as
configured) and each cluster size (nodes of 8 H100s), runs `titanlab.planning.planner.plan`,
its compute priced by the per-op ledger (`titanlab.ledger.planner_costs`),
with a global batch of max(512, GPUs) sequences (4M tokens, 16M at 2048 GPUs: the Llama 3
paper's batch schedule) and writes its first pick (layout, ZeRO stage, AC mode, accumulation
steps), predicted MFU, tokens/s per device and memory per device to the `plan-picks` block of
`--out`. The published layouts they are compared with are in the text around the block.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.bench import write_block

MODELS = {
    "llama_8b": "Llama 3 8B",
    "llama_70b": "Llama 3 70B",
    "llama_405b": "Llama 3 405B",
    "qwen3_30b_a3b": "Qwen3-30B-A3B",
}


def pick(config_name: str, gpus: int) -> str:
    """One table row: the planner's first pick for `config_name` on `gpus` H100s."""
    from titanlab.config.job_config import ConfigError
    from titanlab.config.manager import build_config
    from titanlab.ledger.planner_costs import ledger_costs
    from titanlab.planning import planner
    from titanlab.planning.cluster import PROFILES
    from titanlab.planning.memory import GIB

    batch = max(512, gpus)
    argv = ["--job.config_file", os.path.join(REPO, "train_configs", f"{config_name}.toml"),
            "--training.global_batch_size", str(batch)]  # fmt: skip
    config = build_config(argv)
    cluster = PROFILES["h100"].with_nodes(max(gpus // 8, 1))
    began = time.time()
    try:
        costs = ledger_costs(argv, "h100")  # compute priced by the per-op ledger
        ranked = planner.plan(config, planner.model_args_of(config), cluster, costs=costs)
    except ConfigError as e:
        return f"| {MODELS[config_name]} | {gpus} | {batch} | none fits: {e} | | | | |"
    best = ranked[0]
    p, m = best.prediction, best.memory
    assert p is not None and m is not None
    lay = best.layout
    zero = lay.zero_stage if lay.dp_shard * lay.cp > 1 else "-"
    fitting = sum(c.fits for c in ranked)
    print(f"{config_name} on {gpus}: {lay.name} in {time.time() - began:.0f} s", flush=True)
    return (
        f"| {MODELS[config_name]} | {gpus} | {batch} | {lay.name} | {zero} / {best.ac_mode} / "
        f"{lay.grad_accum} | {p.mfu:.1%} | {p.tokens_per_s_per_device:,.0f} | "
        f"{m.total / GIB:.1f} | {fitting} of {len(ranked)} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 512, 2048])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--out", default=os.path.join(REPO, "docs", "planning.md"))
    a = p.parse_args(argv)
    rows = [
        "| model | H100s | global batch (sequences) | pick | ZeRO / AC / grad accum "
        "| predicted MFU | tokens/s per device | memory per device (GiB) | layouts that run |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    command = " ".join(["python tools/plan_table.py", *(sys.argv[1:] if argv is None else argv)])
    head = f"Command: `{command}` (H100 profile; each config's seq_len, bf16)\n\n"
    for g in sorted(a.gpus):  # the block is rewritten after each row: a long run keeps its rows
        for m in a.models:
            rows.append(pick(m, g))
            write_block(a.out, "plan-picks", head + "\n".join(rows))
    print(head + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
