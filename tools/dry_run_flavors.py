"""The layout planner's pick for every published flavor at a real world size, then its dry run.

    python tools/dry_run_flavors.py [--only "llama3 8B" ...] [--part k/n]

For each family's published flavors (Llama 3, Qwen3 dense and MoE, DeepSeek-V3, gpt-oss, Qwen3.5
dense and MoE; not the debug ones) on the H100 cluster of `FLAVORS` (the world size such a model is trained on), with the
family's shipped config (seq_len, precision, optimizer) and a global batch of 2 sequences per
GPU: `titanlab.planning.planner.plan`'s first pick (its compute priced by the per-op ledger) becomes the options of a dry run
(`comm.mode = "fake_backend"`, `titanlab.trainer.dry_run`), which must build and fit. The picks
go to docs/dry_run_picks.json (CI dry-runs each: tests/unit/trainer/test_dry_run.py) and a table
to docs/dry_run.md. Planning takes from seconds (8 GPUs) to minutes (MoE on hundreds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.bench import write_block
from tools.lib.parts import parse_part, part_of

FLAVORS: dict[str, tuple[str, int]] = {
    "llama3 1B": ("llama_8b.toml", 8),
    "llama3 3B": ("llama_8b.toml", 8),
    "llama3 8B": ("llama_8b.toml", 8),
    "llama3 70B": ("llama_70b.toml", 64),
    "llama3 405B": ("llama_405b.toml", 512),
    "qwen3 0.6B": ("qwen3_8b.toml", 8),
    "qwen3 1.7B": ("qwen3_8b.toml", 8),
    "qwen3 4B": ("qwen3_8b.toml", 8),
    "qwen3 8B": ("qwen3_8b.toml", 8),
    "qwen3 14B": ("qwen3_8b.toml", 16),
    "qwen3 32B": ("qwen3_8b.toml", 32),
    "qwen3_moe 30B-A3B": ("qwen3_30b_a3b.toml", 16),
    "qwen3_moe 235B-A22B": ("qwen3_30b_a3b.toml", 128),
    "deepseek_v3 16B": ("deepseek_v3_671b.toml", 16),
    "deepseek_v3 671B": ("deepseek_v3_671b.toml", 512),
    "gpt_oss 20b": ("gpt_oss_20b.toml", 8),
    "gpt_oss 120b": ("gpt_oss_20b.toml", 64),
    "qwen3_5 0.8B": ("qwen3_5_27b.toml", 8),
    "qwen3_5 2B": ("qwen3_5_27b.toml", 8),
    "qwen3_5 4B": ("qwen3_5_27b.toml", 8),
    "qwen3_5 9B": ("qwen3_5_27b.toml", 8),
    "qwen3_5 27B": ("qwen3_5_27b.toml", 16),
    "qwen3_5_moe 35B-A3B": ("qwen3_5_35b_a3b.toml", 16),
    "qwen3_5_moe 122B-A10B": ("qwen3_5_35b_a3b.toml", 64),
    "qwen3_5_moe 397B-A17B": ("qwen3_5_35b_a3b.toml", 256),
}
"""Family and flavor → (the shipped config it is planned with, H100s)."""

PICKS = os.path.join(REPO, "docs", "dry_run_picks.json")
DOC = os.path.join(REPO, "docs", "dry_run.md")
SECTIONS = ("parallelism", "training", "activation_checkpoint")
"""The config sections a layout changes (`titanlab.planning.layouts.apply_layout`, AC mode)."""


def layout_args(base, picked) -> list[str]:
    """The `--section.key value` options that turn `base` into `picked` (the sections a layout
    sets)."""
    import dataclasses

    out = []
    for section in SECTIONS:
        old, new = getattr(base, section), getattr(picked, section)
        for f in dataclasses.fields(new):
            value = getattr(new, f.name)
            if value != getattr(old, f.name):
                text = str(value).lower() if isinstance(value, bool) else str(value)
                out += [f"--{section}.{f.name}", text]
    return out


def plan_flavor(name: str) -> dict:
    """Plan `name` ("family flavor") and dry-run the pick; its record for the JSON file."""
    from titanlab.config.manager import build_config
    from titanlab.distributed.init import destroy_distributed
    from titanlab.ledger.planner_costs import ledger_costs
    from titanlab.planning import planner
    from titanlab.planning.cluster import PROFILES
    from titanlab.trainer import Trainer, dry_run

    family, flavor = name.split(" ")
    config_file, gpus = FLAVORS[name]
    batch = 2 * gpus
    base_argv = ["--job.config_file", os.path.join(REPO, "train_configs", config_file),
                 "--model.name", family, "--model.flavor", flavor, "--comm.mode", "fake_backend",
                 "--comm.fake_world_size", str(gpus)]  # fmt: skip
    base = build_config([*base_argv, "--training.global_batch_size", str(batch)])
    began = time.time()
    cluster = PROFILES["h100"].with_nodes(gpus // 8)
    costs = ledger_costs(base_argv, "h100")  # compute priced by the per-op ledger
    best = planner.plan(base, planner.model_args_of(base), cluster, costs=costs)[0]
    assert best.config is not None  # a fitting candidate carries its job
    args = layout_args(build_config(base_argv), best.config)
    planned_s = time.time() - began
    try:
        trainer = Trainer(build_config([*base_argv, *args]))
        held = dry_run.rank_bytes(trainer)
        total = trainer.memory.total
    finally:
        destroy_distributed(barrier=False)
    return {
        "config": f"train_configs/{config_file}",
        "world_size": gpus,
        "layout": best.layout.name,
        "ac": best.ac_mode,
        "args": args,
        "planned_s": round(planned_s),
        "rank0_gib": round((held.params + held.grads + held.optimizer) / 2**30, 2),
        "estimate_gib": round(total / 2**30, 1),
    }


def table(picks: dict) -> str:
    rows = [
        "| model | H100s | planner's pick | AC | rank 0 params + grads + optimizer (GiB) "
        "| estimate per GPU (GiB) | planned in (s) |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for name, p in picks.items():
        rows.append(
            f"| {name} | {p['world_size']} | {p['layout']} | {p['ac']} | {p['rank0_gib']:.2f} "
            f"| {p['estimate_gib']:.1f} | {p['planned_s']} |"
        )
    return "Command: `python tools/dry_run_flavors.py` (H100 profile, 79.6 GiB)\n\n" + "\n".join(
        rows
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", default=list(FLAVORS), choices=list(FLAVORS))
    p.add_argument("--part", default="", help="k/n: only the flavors of part k of n (by name)")
    a = p.parse_args(argv)
    if a.part:
        k, n = parse_part(p, a.part)
        a.only = [name for name in a.only if part_of(name, n) == k]
    picks: dict = {}
    if os.path.exists(PICKS):
        with open(PICKS, encoding="utf-8") as f:
            picks = json.load(f)
    for name in a.only:  # written after each flavor: a long run keeps what it planned
        picks[name] = plan_flavor(name)
        print(f"{name}: {picks[name]['layout']} ({picks[name]['planned_s']} s)", flush=True)
        picks = {k: picks[k] for k in FLAVORS if k in picks}
        with open(PICKS, "w", encoding="utf-8") as f:
            json.dump(picks, f, indent=1)
            f.write("\n")
        write_block(DOC, "dry-run-flavors", table(picks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
